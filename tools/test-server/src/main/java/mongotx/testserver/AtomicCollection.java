package mongotx.testserver;

import java.util.ArrayList;
import java.util.Comparator;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeSet;
import java.util.stream.Stream;

import de.bwaldvogel.mongo.MongoDatabase;
import de.bwaldvogel.mongo.backend.ArrayFilters;
import de.bwaldvogel.mongo.backend.CollectionOptions;
import de.bwaldvogel.mongo.backend.CursorRegistry;
import de.bwaldvogel.mongo.backend.Index;
import de.bwaldvogel.mongo.backend.Utils;
import de.bwaldvogel.mongo.backend.QueryParameters;
import de.bwaldvogel.mongo.backend.QueryResult;
import de.bwaldvogel.mongo.backend.memory.MemoryCollection;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.bson.ObjectId;
import de.bwaldvogel.mongo.exception.ImmutableFieldException;
import de.bwaldvogel.mongo.exception.MongoServerException;
import de.bwaldvogel.mongo.oplog.NoopOplog;
import de.bwaldvogel.mongo.wire.bson.BsonEncoder;
import io.netty.buffer.ByteBuf;
import io.netty.buffer.Unpooled;

/**
 * A collection of mongo-java-server's in-memory backend whose documents never leave it while an
 * update can still change them.
 *
 * <p>The stock collection serializes its operations, but queries hand back the live stored
 * {@link Document} objects, which are encoded onto the wire only after the collection lock is
 * released: an update that runs meanwhile changes them in place, so a reader could see a document
 * half-way through a change. Every document that leaves this collection is a deep copy taken while
 * the lock is still held. Every method that reads or changes documents holds the collection's
 * monitor, so {@code synchronized (collection)} makes a read-compute-write sequence atomic.
 */
final class AtomicCollection extends MemoryCollection {

    /** Set while a query's results are being collected for a client. */
    private boolean copying;

    /** Whether scans ask a {@link Prefilter} before the stock matcher. */
    private final boolean prefiltering;

    AtomicCollection(MongoDatabase database, String name, CollectionOptions options, CursorRegistry cursors,
            boolean prefiltering) {
        super(database, name, options, cursors);
        this.prefiltering = prefiltering;
    }

    @Override
    public synchronized QueryResult handleQuery(QueryParameters parameters) {
        boolean outer = copying;
        copying = true;
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
            copies.add(document == null ? null : Copies.deep(document));
        }
        return super.createQueryResult(copies, batchSize);
    }

    /**
     * Rules most documents of a scan out with the filter's {@link Prefilter}, built once for the
     * scan, before the stock matcher sees the rest.
     */
    @Override
    protected QueryResult matchDocumentsFromStream(Document query, Stream<Document> documents, int skip, int limit,
            int batchSize, Comparator<Document> order, Document fieldSelector) {
        Prefilter prefilter = prefiltering ? Prefilter.compile(query) : null;
        if (prefilter != null) {
            documents = documents.filter(prefilter::mayMatch);
        }
        return super.matchDocumentsFromStream(query, documents, skip, limit, batchSize, order, fieldSelector);
    }

    /**
     * Looks a filter with an {@code _id} equality and other conditions, or an {@code _id} {@code $in}
     * list, up in the {@code _id} index (ids that are plain values or embedded documents of them),
     * then checks the whole filter on the documents found, as MongoDB's planner does. The stock
     * collection uses an index only when the filter names exactly its keys, so every conditional
     * write by id (all of mongotx's) scanned the whole collection: a cost that grew with the
     * collection, which MongoDB does not have.
     */
    @Override
    protected QueryResult queryDocuments(Document query, Document orderBy, int skip, int limit, int batchSize,
            Document fieldSelector) {
        Object id = query.get("_id");
        List<Object> wanted = null;
        if (query.size() > 1 && key(id)) {
            wanted = List.of(id);
        } else if (id instanceof Document in && in.size() == 1 && in.get("$in") instanceof List<?> values
                && values.stream().allMatch(AtomicCollection::key)) {
            wanted = new ArrayList<>(values);
        }
        if (wanted != null) {
            Index<Integer> byId = idIndex();
            if (byId != null) {
                Set<Integer> positions = new TreeSet<>();
                // The index compares embedded documents field by field in order, as MongoDB does,
                // and numbers by value, as the matcher does.
                for (Object value : wanted) {
                    for (Integer position : byId.getPositions(new Document("_id", value))) {
                        positions.add(position);
                    }
                }
                // What the index found has the `_id` asked for (equal as the matcher compares plain
                // values): only the other conditions are left to check. Checking the `$in` again
                // would compare each document with every listed id, a cost in the square of a
                // page's size (a page of 2,000 ids took the matcher 4 million comparisons).
                Document rest = new Document(query);
                rest.remove("_id");
                return matchDocuments(rest, positions, orderBy, skip, limit, batchSize, fieldSelector);
            }
        }
        return super.queryDocuments(query, orderBy, skip, limit, batchSize, fieldSelector);
    }

    /** A value the {@code _id} index can look up by equality. */
    private static boolean plain(Object value) {
        return value instanceof String || value instanceof Number || value instanceof ObjectId;
    }

    /**
     * A value the {@code _id} index can find candidates for: a plain one, or an embedded document
     * of plain values (no operators), such as mongotx's quota provider ids.
     */
    private static boolean key(Object value) {
        return plain(value) || value instanceof Document document && !document.isEmpty()
                && document.keySet().stream().noneMatch(k -> k.startsWith("$"))
                && document.values().stream().allMatch(AtomicCollection::key);
    }

    private Index<Integer> idIndex() {
        Document probe = new Document("_id", 0);
        for (Index<Integer> index : getIndexes()) {
            if (index.canHandle(probe)) {
                return index;
            }
        }
        return null;
    }

    /** Copies of the documents matching {@code filter}, in {@code sort} order (may be null), at most {@code limit} (0: all). */
    synchronized List<Document> matching(Document filter, Document sort, int limit) {
        List<Document> found = stored(filter, sort, limit);
        found.replaceAll(document -> document == null ? null : Copies.deep(document));
        return found;
    }

    /**
     * The stored documents themselves (no copies) matching {@code filter}, for a write that holds
     * this collection's lock until it is done with them: it computes each change on a copy of its
     * own, replaces the stored document through {@link #replace}, and copies what it answers with
     * before the lock goes. Copying them here as well was a tenth of the server's time in a GC run.
     */
    synchronized List<Document> stored(Document filter, Document sort, int limit) {
        Document selector = new Document("$query", filter);
        if (sort != null && !sort.isEmpty()) {
            selector.put("$orderby", sort);
        }
        List<Document> found = new ArrayList<>();
        for (Document document : super.handleQuery(new QueryParameters(selector, 0, limit))) {
            found.add(document);
        }
        return found;
    }

    /**
     * Replaces the stored document whose {@code _id} is {@code id} (the stored value itself) by
     * {@code replacement}; {@code old} is that stored document (or a copy of it), found by the
     * caller under this collection's lock, which it still holds. Every index checks the change
     * first, as the stock update path does; unlike that path, the document is not looked up,
     * copied and encoded (twice) again, three steps that were a fifth of the server's time in a GC
     * run.
     */
    synchronized void replace(Object id, Document old, Document replacement) {
        Integer position = positionOf(id);
        if (position == null) {
            updateDocuments(new Document("_id", id), replacement, ArrayFilters.empty(), false, false,
                    NoopOplog.get());
            return;
        }
        Object newId = replacement.get("_id");
        if (newId != null && !JsonSchema.equal(id, newId)) {
            throw new ImmutableFieldException(
                    "After applying the update, the (immutable) field '_id' was found to have been altered to _id: "
                            + newId);
        }
        Document next = new Document();
        next.put("_id", id);
        next.putAll(replacement);
        Utils.validateFieldNames(next);
        for (String key : next.keySet()) {
            if (key.contains(".")) {
                throw new MongoServerException("illegal field name: " + key);
            }
        }
        for (Index<Integer> index : getIndexes()) {
            index.checkUpdate(old, next, this);
        }
        for (Index<Integer> index : getIndexes()) {
            index.updateInPlace(old, next, position, this);
        }
        // The stored document keeps no part of the replacement, which the caller still hands out
        // (a post-image) after the lock is released. Its fields take the replacement's order, as
        // MongoDB stores a replacement (https://www.mongodb.com/docs/manual/core/document/#document-field-order):
        // updating the stored map in place would keep each field where it was.
        Document stored = getDocument(position);
        stored.clear();
        for (Map.Entry<String, Object> entry : next.entrySet()) {
            stored.put(entry.getKey(), Copies.deepValue(entry.getValue()));
        }
    }

    /** Where the document whose {@code _id} is {@code id} is stored, by the {@code _id} index; null without one. */
    private Integer positionOf(Object id) {
        Index<Integer> byId = idIndex();
        if (byId == null) {
            return null;
        }
        Integer found = null;
        for (Integer position : byId.getPositions(new Document("_id", id))) {
            if (found != null) {
                return null;
            }
            found = position;
        }
        return found;
    }

    /**
     * Sizes are summed when asked (collStats, dbStats) instead of kept up to date: keeping them
     * encoded every document twice per update and once per insert and delete, for a number only
     * statistics read.
     */
    @Override
    protected boolean tracksDataSize() {
        return false;
    }

    @Override
    protected synchronized int getDataSize() {
        long total = streamAllDocumentsWithPosition()
                .mapToLong(entry -> bsonSize(entry.getDocument()))
                .sum();
        return (int) Math.min(Integer.MAX_VALUE, total);
    }

    private static int bsonSize(Document document) {
        ByteBuf buffer = Unpooled.buffer();
        try {
            BsonEncoder.encodeDocument(document, buffer);
            return buffer.writerIndex();
        } finally {
            buffer.release();
        }
    }

    /** The index called {@code name}, or null. */
    synchronized Index<Integer> index(String name) {
        for (Index<Integer> index : getIndexes()) {
            if (index.getName().equals(name)) {
                return index;
            }
        }
        return null;
    }
}
