package mongotx.testserver;

import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

import de.bwaldvogel.mongo.MongoCollection;
import de.bwaldvogel.mongo.backend.CollectionOptions;
import de.bwaldvogel.mongo.backend.CursorRegistry;
import de.bwaldvogel.mongo.backend.DatabaseResolver;
import de.bwaldvogel.mongo.backend.aggregation.Aggregation;
import de.bwaldvogel.mongo.backend.memory.MemoryCollection;
import de.bwaldvogel.mongo.backend.memory.MemoryDatabase;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;
import de.bwaldvogel.mongo.oplog.Oplog;
import io.netty.channel.Channel;

/**
 * A database of the test server: mongo-java-server's in-memory database, with the write commands
 * run by {@link Writes}, statement variables ({@code $$NOW} per collection clock, {@code let}) in
 * reads, MongoDB's stage aliases in aggregations, and collection validators ({@code create} with a
 * {@code validator}, {@code collMod}, {@code listCollections} showing them).
 */
final class AtomicDatabase extends MemoryDatabase {

    private final Map<String, Validator> validators = new ConcurrentHashMap<>();
    /** Default collations by collection (binary where absent). */
    private final Map<String, Document> collations = new ConcurrentHashMap<>();
    private final Profile profile;
    private final Clocks clocks;
    private final Writes writes;
    private final boolean prefilter;

    AtomicDatabase(String databaseName, CursorRegistry cursorRegistry, Profile profile, Clocks clocks,
            boolean prefilter) {
        super(databaseName, cursorRegistry);
        this.profile = profile;
        this.clocks = clocks;
        this.prefilter = prefilter;
        this.writes = new Writes(this, profile, clocks);
    }

    @Override
    protected MemoryCollection openOrCreateCollection(String collectionName, CollectionOptions options) {
        return new AtomicCollection(this, collectionName, options, cursorRegistry, prefilter);
    }

    @Override
    public Document handleCommand(Channel channel, String command, Document query, DatabaseResolver resolver,
            Oplog oplog) {
        Document collation = query.get(command) instanceof String name ? collations.get(name) : null;
        return Collation.during(query, collation == null ? null : Collation.of(collation),
                () -> run(channel, command, query, resolver, oplog));
    }

    private Document run(Channel channel, String command, Document query, DatabaseResolver resolver, Oplog oplog) {
        switch (command.toLowerCase(Locale.ROOT)) {
            case "insert":
                return writes.insert(query);
            case "update":
                return writes.update(query, resolver, oplog);
            case "delete":
                return writes.delete(query, oplog);
            case "findandmodify":
                return writes.findAndModify(query, resolver, oplog);
            case "find":
                return super.handleCommand(channel, command,
                        with(query, "filter", variables(query, command).inFilter(filterOf(query, "filter"))), resolver,
                        oplog);
            case "count":
            case "distinct":
                return super.handleCommand(channel, command,
                        with(query, "query", variables(query, command).inFilter(filterOf(query, "query"))), resolver,
                        oplog);
            case "aggregate":
                if (query.get("pipeline") instanceof List<?> stages) {
                    query = with(query, "pipeline", variables(query, command).inPipeline(stages));
                    Document matched = matchFirst(query, resolver, oplog);
                    if (matched != null) {
                        return matched;
                    }
                }
                return super.handleCommand(channel, command, query, resolver, oplog);
            case "create":
                return create(channel, command, query, resolver, oplog);
            case "collmod":
                return collMod(query);
            case "listcollections":
                return listCollections(channel, command, query, resolver, oplog);
            case "drop":
                validators.remove(String.valueOf(query.get(command)));
                collations.remove(String.valueOf(query.get(command)));
                return super.handleCommand(channel, command, query, resolver, oplog);
            default:
                return super.handleCommand(channel, command, query, resolver, oplog);
        }
    }

    /** Stages a pipeline that starts with {@code $match} may go on with, run over the matched documents. */
    private static final Set<String> AFTER_MATCH = Set.of("$match", "$addFields", "$set", "$project", "$unset",
            "$replaceRoot", "$replaceWith", "$sort", "$limit", "$skip", "$group", "$count", "$unwind");

    /**
     * Runs an aggregation whose first stage is {@code $match} as MongoDB does: the match is a query
     * on the collection (indexes and all), and only the documents it matches are copied and go
     * through the later stages. The stock server copies every document of the collection into the
     * pipeline first, so an aggregation cost as much as the whole collection weighs, however few
     * documents it matched. Null when the pipeline is not of that shape (the stock path runs it).
     */
    private Document matchFirst(Document query, DatabaseResolver resolver, Oplog oplog) {
        String name = String.valueOf(query.get("aggregate"));
        if (!(query.get("pipeline") instanceof List<?> stages) || stages.isEmpty()
                || !(stages.get(0) instanceof Document first) || first.size() != 1
                || !(first.get("$match") instanceof Document match) || query.containsKey("explain")) {
            return null;
        }
        for (Object stage : stages) {
            if (!(stage instanceof Document d) || d.size() != 1 || !AFTER_MATCH.contains(d.keySet().iterator().next())) {
                return null;
            }
        }
        AtomicCollection collection = existing(name);
        if (collection == null) {
            return null;
        }
        // A $sort and a $limit right after the match are the query's own sort and limit, as MongoDB
        // pushes them down: a pipeline that wants the first document of a large collection then
        // copies one document, not the collection.
        int next = 1;
        Document sort = null;
        if (next < stages.size() && stages.get(next) instanceof Document d && d.get("$sort") instanceof Document s
                && !s.isEmpty()) {
            sort = s;
            next++;
        }
        int limit = 0;
        if (next < stages.size() && stages.get(next) instanceof Document d
                && d.get("$limit") instanceof Number n && n.longValue() > 0 && n.longValue() <= Integer.MAX_VALUE
                && n.doubleValue() == n.longValue()) {
            limit = n.intValue();
            next++;
        }
        if (sort != null && limit == 0) {
            // A sort alone stays a stage: the query's sort is only applied together with a limit here.
            sort = null;
            next = 1;
        }
        List<Document> matched = collection.matching(match, sort, limit);
        Aggregation rest = Aggregation.fromPipeline((Object) new ArrayList<>(stages.subList(next, stages.size())),
                resolver, this, collection, oplog);
        List<Document> result = rest.runStages(matched.stream());
        Document cursor = new Document("firstBatch", result);
        cursor.put("id", 0L);
        cursor.put("ns", getFullCollectionNamespace(name));
        Document reply = new Document("cursor", cursor);
        reply.put("ok", 1.0);
        return reply;
    }

    /** The collection a write goes to, created if absent (as MongoDB does on a first write). */
    AtomicCollection collectionForWrite(String name) {
        if (name.startsWith("system.")) {
            throw new MongoServerError(73, "InvalidNamespace", "cannot write to '" + getDatabaseName() + "." + name + "'");
        }
        return (AtomicCollection) resolveOrCreateCollection(name);
    }

    /** The collection if it exists. */
    AtomicCollection existing(String name) {
        MongoCollection<Integer> collection = resolveCollection(name, false);
        return (AtomicCollection) collection;
    }

    /** The collection's validator, or null. */
    Validator validator(String collection) {
        return validators.get(collection);
    }

    private Variables variables(Document query, String command) {
        String collection = String.valueOf(query.get(command));
        Document let = null;
        if (query.containsKey("let")) {
            if (!profile.acceptsLet()) {
                throw new MongoServerError(40415, "Location40415", "BSON field '" + command + ".let' is an unknown field.");
            }
            let = (Document) query.get("let");
            query.remove("let");
        }
        return Variables.of(clocks.now(collection), let);
    }

    private static Document filterOf(Document query, String field) {
        return query.get(field) instanceof Document filter ? filter : new Document();
    }

    private static Document with(Document query, String field, Object value) {
        Document copy = new Document();
        copy.putAll(query);
        copy.put(field, value);
        return copy;
    }

    private Document create(Channel channel, String command, Document query, DatabaseResolver resolver, Oplog oplog) {
        String name = String.valueOf(query.get(command));
        Validator validator = Validator.of(query, null);
        Document collation = query.get("collation") instanceof Document given ? given : null;
        if (collation != null) {
            Collation.of(collation);
        }
        Document plain = new Document();
        for (Map.Entry<String, Object> entry : query.entrySet()) {
            String key = entry.getKey();
            if (!Set.of("validator", "validationLevel", "validationAction", "collation").contains(key)) {
                plain.put(key, entry.getValue());
            }
        }
        Document reply = super.handleCommand(channel, command, plain, resolver, oplog);
        if (validator != null) {
            validators.put(name, validator);
        }
        if (collation != null && !"simple".equals(collation.get("locale"))) {
            collations.put(name, collation);
        }
        return reply;
    }

    private Document collMod(Document query) {
        String name = String.valueOf(query.get("collMod"));
        if (existing(name) == null) {
            throw new MongoServerError(26, "NamespaceNotFound", "ns does not exist: " + getDatabaseName() + "." + name);
        }
        for (String key : query.keySet()) {
            if (!List.of("collMod", "validator", "validationLevel", "validationAction", "$db", "lsid", "$clusterTime",
                    "writeConcern", "comment", "$readPreference").contains(key)) {
                throw new MongoServerError(72, "InvalidOptions",
                        "collMod option '" + key + "' is not supported by the mongotx test server");
            }
        }
        validators.compute(name, (k, previous) -> Validator.of(query, previous));
        return new Document("ok", 1.0);
    }

    @SuppressWarnings("unchecked")
    private Document listCollections(Channel channel, String command, Document query, DatabaseResolver resolver,
            Oplog oplog) {
        Document reply = super.handleCommand(channel, command, query, resolver, oplog);
        Object name = query.get("filter") instanceof Document filter ? filter.get("name") : null;
        if (reply.get("cursor") instanceof Document cursor && cursor.get("firstBatch") instanceof List<?> batch) {
            List<Object> kept = new java.util.ArrayList<>();
            for (Object item : batch) {
                Document entry = (Document) item;
                if (name instanceof String wanted && !wanted.equals(entry.get("name"))) {
                    continue;
                }
                Validator validator = validators.get(String.valueOf(entry.get("name")));
                Document collation = collations.get(String.valueOf(entry.get("name")));
                if (validator != null || collation != null) {
                    Document options = entry.get("options") instanceof Document o ? o : new Document();
                    if (validator != null) {
                        options.putAll(validator.options());
                    }
                    if (collation != null) {
                        options.put("collation", collation);
                    }
                    entry.put("options", options);
                }
                kept.add(entry);
            }
            cursor.put("firstBatch", kept);
        }
        return reply;
    }
}
