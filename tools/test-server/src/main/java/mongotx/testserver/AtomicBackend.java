package mongotx.testserver;

import java.util.ArrayList;
import java.util.List;
import java.util.stream.Stream;

import de.bwaldvogel.mongo.MongoCollection;
import de.bwaldvogel.mongo.MongoDatabase;
import de.bwaldvogel.mongo.backend.CollectionOptions;
import de.bwaldvogel.mongo.backend.CursorRegistry;
import de.bwaldvogel.mongo.backend.DatabaseResolver;
import de.bwaldvogel.mongo.backend.QueryParameters;
import de.bwaldvogel.mongo.backend.QueryResult;
import de.bwaldvogel.mongo.backend.aggregation.Aggregation;
import de.bwaldvogel.mongo.backend.memory.MemoryBackend;
import de.bwaldvogel.mongo.backend.memory.MemoryCollection;
import de.bwaldvogel.mongo.backend.memory.MemoryDatabase;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;
import de.bwaldvogel.mongo.exception.MongoServerException;
import de.bwaldvogel.mongo.oplog.Oplog;
import io.netty.channel.Channel;

/**
 * mongo-java-server's in-memory backend with single-document atomicity made to hold for readers.
 *
 * <p>The stock collection serializes its operations, but queries and findAndModify hand back the
 * live stored {@link Document} objects, which are encoded onto the wire only after the collection
 * lock is released. An update that runs meanwhile mutates them in place, so a reader can see a
 * document half-way through a change, and two concurrent findAndModify calls with {@code new: true}
 * can both return the later post-image. Every document that leaves a collection here is a deep copy
 * taken while the lock is still held.
 *
 * <p>It also answers {@code hello} (the modern handshake) like {@code isMaster}, and runs updates
 * given as an aggregation pipeline (MongoDB 4.2+), which the stock server refuses: the matching
 * document is found and transformed by the pipeline with the aggregation engine (so {@code $$NOW}
 * is the server's clock), then stored in its place, all under the collection's lock. Only
 * single-document pipeline updates are supported. An upsert that matches nothing runs the pipeline
 * over the document the filter's plain equalities describe (as MongoDB does) and inserts the result.
 *
 * <p>With {@code bulkWrites} it runs MongoDB 8.0's {@code bulkWrite} command (many writes on any
 * collections in one message): each operation goes through this server's own {@code insert},
 * {@code update} or {@code delete} handling, one at a time, so each keeps its single-document
 * atomicity, and the reply lists every operation's outcome as MongoDB 8.0 does.
 */
final class AtomicBackend extends MemoryBackend {

    private final boolean bulkWrites;

    AtomicBackend(boolean bulkWrites) {
        this.bulkWrites = bulkWrites;
    }

    @Override
    public MemoryDatabase openOrCreateDatabase(String databaseName) {
        return new AtomicDatabase(databaseName, getCursorRegistry());
    }

    @Override
    public Document handleCommand(Channel channel, String databaseName, String command, Document query) {
        if (command.equalsIgnoreCase("hello")) {
            Document response = super.handleCommand(channel, databaseName, "ismaster", query);
            response.put("isWritablePrimary", Boolean.TRUE);
            return response;
        }
        if (bulkWrites && command.equalsIgnoreCase("bulkWrite")) {
            return bulkWrite(channel, query);
        }
        return super.handleCommand(channel, databaseName, command, query);
    }

    /**
     * MongoDB 8.0's {@code bulkWrite}: {@code ops} name their namespace by its index in
     * {@code nsInfo}; each runs as its own single-statement command; an ordered bulk stops at the
     * first failed operation. Results come back in a cursor's first batch (errors only with
     * {@code errorsOnly}), with the totals beside it.
     */
    private Document bulkWrite(Channel channel, Document query) {
        List<?> ops = query.get("ops") instanceof List<?> list ? list : List.of();
        List<?> namespaces = query.get("nsInfo") instanceof List<?> list ? list : List.of();
        boolean ordered = !Boolean.FALSE.equals(query.get("ordered"));
        boolean errorsOnly = Boolean.TRUE.equals(query.get("errorsOnly"));
        int errors = 0;
        int inserted = 0;
        int matched = 0;
        int modified = 0;
        int upserted = 0;
        int deleted = 0;
        List<Object> results = new ArrayList<>();
        for (int idx = 0; idx < ops.size(); idx++) {
            Document outcome;
            String kind = null;
            try {
                Document op = (Document) ops.get(idx);
                kind = op.containsKey("insert") ? "insert" : op.containsKey("update") ? "update" : "delete";
                Object nsIndex = op.get(kind);
                if (!(nsIndex instanceof Number n) || n.intValue() < 0 || n.intValue() >= namespaces.size()) {
                    throw new MongoServerError(2, "bulkWrite operation " + idx + " names no namespace in nsInfo");
                }
                String ns = String.valueOf(((Document) namespaces.get(n.intValue())).get("ns"));
                int dot = ns.indexOf('.');
                if (dot <= 0) {
                    throw new MongoServerError(73, "InvalidNamespace", "invalid namespace: " + ns);
                }
                Document reply = handleCommand(channel, ns.substring(0, dot), kind,
                        single(kind, ns.substring(dot + 1), op));
                outcome = outcome(reply);
            } catch (MongoServerError e) {
                outcome = new Document("ok", 0.0).append("code", e.getCode()).append("codeName", e.getCodeName())
                        .append("errmsg", e.getMessageWithoutErrorCode());
            } catch (MongoServerException | ClassCastException e) {
                outcome = new Document("ok", 0.0).append("code", 2).append("errmsg", String.valueOf(e.getMessage()));
            }
            boolean failed = outcome.get("ok") instanceof Number ok && ok.doubleValue() == 0.0;
            if (failed) {
                errors += 1;
            } else {
                int n = ((Number) outcome.getOrDefault("n", 0)).intValue();
                switch (kind) {
                    case "insert" -> inserted += n;
                    case "delete" -> deleted += n;
                    default -> {
                        if (outcome.containsKey("upserted")) {
                            upserted += 1;
                        } else {
                            matched += n;
                        }
                        modified += ((Number) outcome.getOrDefault("nModified", 0)).intValue();
                    }
                }
            }
            if (failed || !errorsOnly) {
                results.add(new Document("idx", idx).appendAll(outcome));
            }
            if (failed && ordered) {
                break;
            }
        }
        Document cursor = new Document("id", 0L).append("firstBatch", results).append("ns", "admin.$cmd.bulkWrite");
        return new Document("cursor", cursor).append("nErrors", errors).append("nInserted", inserted)
                .append("nMatched", matched).append("nModified", modified).append("nUpserted", upserted)
                .append("nDeleted", deleted).append("ok", 1.0);
    }

    /** The single-statement command that runs one operation of a {@code bulkWrite}. */
    private static Document single(String kind, String collection, Document op) {
        List<Object> statements = new ArrayList<>();
        switch (kind) {
            case "insert" -> {
                statements.add(op.get("document"));
                return new Document("insert", collection).append("documents", statements).append("ordered", Boolean.TRUE);
            }
            case "update" -> {
                Document statement = new Document("q", op.getOrDefault("filter", new Document()))
                        .append("u", op.get("updateMods"))
                        .append("multi", Boolean.TRUE.equals(op.get("multi")))
                        .append("upsert", Boolean.TRUE.equals(op.get("upsert")));
                if (op.containsKey("arrayFilters")) {
                    statement.append("arrayFilters", op.get("arrayFilters"));
                }
                statements.add(statement);
                return new Document("update", collection).append("updates", statements).append("ordered", Boolean.TRUE);
            }
            default -> {
                statements.add(new Document("q", op.getOrDefault("filter", new Document()))
                        .append("limit", Boolean.TRUE.equals(op.get("multi")) ? 0 : 1));
                return new Document("delete", collection).append("deletes", statements).append("ordered", Boolean.TRUE);
            }
        }
    }

    /** One operation's entry in a {@code bulkWrite} reply, from its single-statement command's reply. */
    private static Document outcome(Document reply) {
        if (reply.get("writeErrors") instanceof List<?> refused && !refused.isEmpty()) {
            Document error = (Document) refused.get(0);
            return new Document("ok", 0.0).append("code", error.get("code"))
                    .append("codeName", error.getOrDefault("codeName", "Location" + error.get("code")))
                    .append("errmsg", error.get("errmsg"));
        }
        Document outcome = new Document("ok", 1.0).append("n", reply.getOrDefault("n", 0));
        if (reply.containsKey("nModified")) {
            outcome.append("nModified", reply.get("nModified"));
        }
        if (reply.get("upserted") instanceof List<?> made && !made.isEmpty()) {
            outcome.append("upserted", new Document("_id", ((Document) made.get(0)).get("_id")));
        }
        return outcome;
    }

    private static final class AtomicDatabase extends MemoryDatabase {

        AtomicDatabase(String databaseName, CursorRegistry cursorRegistry) {
            super(databaseName, cursorRegistry);
        }

        @Override
        protected MemoryCollection openOrCreateCollection(String collectionName, CollectionOptions options) {
            return new AtomicCollection(this, collectionName, options, cursorRegistry);
        }

        @Override
        public Document handleCommand(Channel channel, String command, Document query, DatabaseResolver resolver,
                Oplog oplog) {
            if (command.equalsIgnoreCase("update") && hasPipeline(query)) {
                return pipelineUpdate(channel, query, resolver, oplog);
            }
            if (command.equalsIgnoreCase("findAndModify") && query.get("update") instanceof List<?> stages) {
                return pipelineFindAndModify(channel, query, stages, resolver, oplog);
            }
            return super.handleCommand(channel, command, query, resolver, oplog);
        }

        private static boolean hasPipeline(Document query) {
            if (!(query.get("updates") instanceof List<?> updates)) {
                return false;
            }
            for (Object statement : updates) {
                if (statement instanceof Document d && d.get("u") instanceof List) {
                    return true;
                }
            }
            return false;
        }

        private Document pipelineUpdate(Channel channel, Document query, DatabaseResolver resolver, Oplog oplog) {
            String name = String.valueOf(query.get("update"));
            int matched = 0;
            int modified = 0;
            List<Object> upserted = new ArrayList<>();
            List<Object> errors = new ArrayList<>();
            int index = -1;
            for (Object item : (List<?>) query.get("updates")) {
                index += 1;
                Document statement = (Document) item;
                Document reply;
                if (!(statement.get("u") instanceof List<?> stages)) {
                    reply = super.handleCommand(channel, "update", single(name, statement), resolver, oplog);
                } else {
                    if (Boolean.TRUE.equals(statement.get("multi"))) {
                        throw new MongoServerError(2,
                                "the mongotx test server runs pipeline updates of one document only");
                    }
                    boolean upsert = Boolean.TRUE.equals(statement.get("upsert"));
                    MongoCollection<?> collection = upsert ? resolveOrCreateCollection(name) : resolveCollection(name, false);
                    if (collection == null) {
                        continue;
                    }
                    // Every change to the collection takes this lock, so nothing can change the
                    // document between the pipeline reading it and its result replacing it.
                    synchronized (collection) {
                        Document filter = statement.get("q") instanceof Document q ? q : new Document();
                        Document current = first(collection, filter);
                        if (current == null) {
                            if (upsert) {
                                Object outcome = upsertPipeline(channel, name, collection, statement, stages, resolver, oplog);
                                if (outcome instanceof Document error) {
                                    errors.add(error.append("index", index));
                                } else {
                                    upserted.add(new Document("index", index).append("_id", outcome));
                                    matched += 1;
                                }
                            }
                            continue;
                        }
                        Document next = transform(collection, current, stages, resolver, oplog);
                        Document replacement = new Document("q", new Document("_id", next.get("_id"))).append("u", next);
                        reply = super.handleCommand(channel, "update", single(name, replacement), resolver, oplog);
                    }
                }
                matched += ((Number) reply.getOrDefault("n", 0)).intValue();
                modified += ((Number) reply.getOrDefault("nModified", 0)).intValue();
            }
            Document reply = new Document("n", matched).append("nModified", modified);
            if (!upserted.isEmpty()) {
                reply.append("upserted", upserted);
            }
            if (!errors.isEmpty()) {
                reply.append("writeErrors", errors);
            }
            return reply.append("ok", 1.0);
        }

        /**
         * The insert half of a pipeline upsert, run under the collection's lock: the seed is the
         * filter's top-level equalities on plain values; the pipeline transforms it and the result
         * is inserted. Returns the new document's {@code _id}, or the write error (a duplicate key)
         * that refused the insert.
         */
        private Object upsertPipeline(Channel channel, String name, MongoCollection<?> collection, Document statement,
                List<?> stages, DatabaseResolver resolver, Oplog oplog) {
            Document seed = new Document();
            if (statement.get("q") instanceof Document filter) {
                for (String key : filter.keySet()) {
                    Object value = filter.get(key);
                    boolean operator = value instanceof Document d
                            && d.keySet().stream().anyMatch(k -> k.startsWith("$"));
                    if (!key.startsWith("$") && !key.contains(".") && !operator) {
                        seed.put(key, value);
                    }
                }
            }
            if (!seed.containsKey("_id")) {
                seed.put("_id", new de.bwaldvogel.mongo.bson.ObjectId());
            }
            Document created = transform(collection, seed, stages, resolver, oplog);
            // As in MongoDB, the pipeline cannot change the new document's _id.
            created.put("_id", seed.get("_id"));
            List<Object> documents = new ArrayList<>();
            documents.add(created);
            Document insert = new Document("insert", name).append("documents", documents).append("ordered", Boolean.TRUE);
            Document inserted = super.handleCommand(channel, "insert", insert, resolver, oplog);
            if (inserted.get("writeErrors") instanceof List<?> refused && !refused.isEmpty()) {
                Document error = (Document) refused.get(0);
                return new Document("code", error.get("code")).append("errmsg", error.get("errmsg"));
            }
            return seed.get("_id");
        }

        /**
         * findAndModify with a pipeline update: the matching document (the first by natural order)
         * is transformed as in {@link #pipelineUpdate}, or, with {@code upsert}, a new one is made
         * from the filter's equalities; the reply carries the document before or after.
         */
        private Document pipelineFindAndModify(Channel channel, Document query, List<?> stages,
                DatabaseResolver resolver, Oplog oplog) {
            String name = String.valueOf(query.containsKey("findAndModify") ? query.get("findAndModify")
                    : query.get("findandmodify"));
            boolean upsert = Boolean.TRUE.equals(query.get("upsert"));
            boolean returnNew = Boolean.TRUE.equals(query.get("new"));
            Document filter = query.get("query") instanceof Document q ? q : new Document();
            MongoCollection<?> collection = upsert ? resolveOrCreateCollection(name) : resolveCollection(name, false);
            Document lastError = new Document("n", 0).append("updatedExisting", Boolean.FALSE);
            Object value = null;
            if (collection != null) {
                synchronized (collection) {
                    Document pre = first(collection, filter);
                    if (pre != null) {
                        Document next = transform(collection, pre.cloneDeeply(), stages, resolver, oplog);
                        Document replacement = new Document("q", new Document("_id", pre.get("_id"))).append("u", next);
                        super.handleCommand(channel, "update", single(name, replacement), resolver, oplog);
                        lastError = new Document("n", 1).append("updatedExisting", Boolean.TRUE);
                        value = returnNew ? next.cloneDeeply() : pre;
                    } else if (upsert) {
                        Document statement = new Document("q", filter);
                        Object outcome = upsertPipeline(channel, name, collection, statement, stages, resolver, oplog);
                        if (outcome instanceof Document error) {
                            throw new MongoServerError(((Number) error.get("code")).intValue(),
                                    String.valueOf(error.get("errmsg")));
                        }
                        lastError = new Document("n", 1).append("updatedExisting", Boolean.FALSE)
                                .append("upserted", outcome);
                        if (returnNew) {
                            value = first(collection, new Document("_id", outcome));
                        }
                    }
                }
            }
            if (value instanceof Document found && query.get("fields") instanceof Document fields
                    && !fields.isEmpty()) {
                value = project(found, fields);
            }
            return new Document("lastErrorObject", lastError).append("value", value).append("ok", 1.0);
        }

        /**
         * A findAndModify projection on top-level fields: the fields it includes (and {@code _id}
         * unless excluded), or every field but those it excludes.
         */
        private static Document project(Document document, Document fields) {
            boolean inclusion = fields.entrySet().stream()
                    .anyMatch(e -> !e.getKey().equals("_id") && truthy(e.getValue()));
            Document projected = new Document();
            for (String key : document.keySet()) {
                boolean named = fields.containsKey(key);
                boolean keep = key.equals("_id") ? !named || truthy(fields.get(key))
                        : inclusion ? named && truthy(fields.get(key)) : !named;
                if (keep) {
                    projected.put(key, document.get(key));
                }
            }
            return projected;
        }

        private static boolean truthy(Object value) {
            return value instanceof Boolean b ? b : value instanceof Number n && n.doubleValue() != 0.0;
        }

        /**
         * The first document matching {@code filter}, found the way a query finds it (through the
         * {@code _id} index when the filter names an id, as MongoDB would), as a copy; null if none.
         */
        private static Document first(MongoCollection<?> collection, Document filter) {
            for (Document document : collection.handleQuery(new QueryParameters(filter, 0, 1))) {
                return document;
            }
            return null;
        }

        /**
         * The pipeline's stages run over one document with the aggregation engine (so
         * {@code $$NOW} is the server's clock). Running them over the document alone, rather than
         * as an aggregation of the whole collection, keeps a pipeline update's cost independent of
         * the collection's size.
         */
        private Document transform(MongoCollection<?> collection, Document document, List<?> stages,
                DatabaseResolver resolver, Oplog oplog) {
            Aggregation aggregation = Aggregation.fromPipeline((Object) new ArrayList<Object>(stages), resolver, this,
                    collection, oplog);
            List<Document> out = aggregation.runStages(Stream.of(document));
            if (out.size() != 1) {
                throw new MongoServerError(2, "a pipeline update must produce exactly one document, got " + out.size());
            }
            return out.get(0).cloneDeeply();
        }

        private static Document single(String collection, Document statement) {
            List<Object> updates = new ArrayList<>();
            updates.add(statement);
            return new Document("update", collection).append("updates", updates).append("ordered", Boolean.TRUE);
        }
    }

    private static final class AtomicCollection extends MemoryCollection {

        /** Set while findAndModify runs: its own lookup must see the stored objects to change them. */
        private boolean modifying;
        /** Set while a query's results are being collected for a client. */
        private boolean copying;

        AtomicCollection(MongoDatabase database, String name, CollectionOptions options, CursorRegistry cursors) {
            super(database, name, options, cursors);
        }

        @Override
        public synchronized QueryResult handleQuery(QueryParameters parameters) {
            boolean outer = copying;
            copying = !modifying;
            try {
                return super.handleQuery(parameters);
            } finally {
                copying = outer;
            }
        }

        @Override
        protected QueryResult createQueryResult(List<Document> matched, int batchSize) {
            if (!copying) {
                return super.createQueryResult(matched, batchSize);
            }
            List<Document> copies = new ArrayList<>(matched.size());
            for (Document document : matched) {
                copies.add(document == null ? null : document.cloneDeeply());
            }
            return super.createQueryResult(copies, batchSize);
        }

        @Override
        public synchronized Document findAndModify(Document query) {
            modifying = true;
            try {
                Document result = super.findAndModify(query);
                if (result.get("value") instanceof Document value) {
                    result.put("value", value.cloneDeeply());
                }
                return result;
            } finally {
                modifying = false;
            }
        }
    }
}
