package mongotx.testserver;

import java.util.ArrayList;
import java.util.List;

import de.bwaldvogel.mongo.MongoCollection;
import de.bwaldvogel.mongo.MongoDatabase;
import de.bwaldvogel.mongo.backend.CollectionOptions;
import de.bwaldvogel.mongo.backend.CursorRegistry;
import de.bwaldvogel.mongo.backend.DatabaseResolver;
import de.bwaldvogel.mongo.backend.QueryParameters;
import de.bwaldvogel.mongo.backend.QueryResult;
import de.bwaldvogel.mongo.backend.memory.MemoryBackend;
import de.bwaldvogel.mongo.backend.memory.MemoryCollection;
import de.bwaldvogel.mongo.backend.memory.MemoryDatabase;
import de.bwaldvogel.mongo.bson.Document;
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
 * single-document pipeline updates without upsert are supported.
 */
final class AtomicBackend extends MemoryBackend {

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
        return super.handleCommand(channel, databaseName, command, query);
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
            for (Object item : (List<?>) query.get("updates")) {
                Document statement = (Document) item;
                Document reply;
                if (!(statement.get("u") instanceof List<?> stages)) {
                    reply = super.handleCommand(channel, "update", single(name, statement), resolver, oplog);
                } else {
                    if (Boolean.TRUE.equals(statement.get("upsert")) || Boolean.TRUE.equals(statement.get("multi"))) {
                        throw new MongoServerException(
                                "the mongotx test server runs pipeline updates of one document without upsert only");
                    }
                    MongoCollection<?> collection = resolveCollection(name, false);
                    if (collection == null) {
                        continue;
                    }
                    // Every change to the collection takes this lock, so nothing can change the
                    // document between the pipeline reading it and its result replacing it.
                    synchronized (collection) {
                        List<Object> pipeline = new ArrayList<>();
                        Object filter = statement.get("q");
                        pipeline.add(new Document("$match", filter == null ? new Document() : filter));
                        pipeline.add(new Document("$limit", 1));
                        pipeline.addAll(stages);
                        Document aggregate = new Document("aggregate", name)
                                .append("pipeline", pipeline)
                                .append("cursor", new Document());
                        Document result = super.handleCommand(channel, "aggregate", aggregate, resolver, oplog);
                        List<?> batch = (List<?>) ((Document) result.get("cursor")).get("firstBatch");
                        if (batch.isEmpty()) {
                            continue;
                        }
                        Document next = ((Document) batch.get(0)).cloneDeeply();
                        Document replacement = new Document("q", new Document("_id", next.get("_id"))).append("u", next);
                        reply = super.handleCommand(channel, "update", single(name, replacement), resolver, oplog);
                    }
                }
                matched += ((Number) reply.getOrDefault("n", 0)).intValue();
                modified += ((Number) reply.getOrDefault("nModified", 0)).intValue();
            }
            return new Document("n", matched).append("nModified", modified).append("ok", 1.0);
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
