package mongotx.testserver;

import java.util.ArrayList;
import java.util.List;

import de.bwaldvogel.mongo.MongoDatabase;
import de.bwaldvogel.mongo.backend.CollectionOptions;
import de.bwaldvogel.mongo.backend.CursorRegistry;
import de.bwaldvogel.mongo.backend.QueryParameters;
import de.bwaldvogel.mongo.backend.QueryResult;
import de.bwaldvogel.mongo.backend.memory.MemoryBackend;
import de.bwaldvogel.mongo.backend.memory.MemoryCollection;
import de.bwaldvogel.mongo.backend.memory.MemoryDatabase;
import de.bwaldvogel.mongo.bson.Document;
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
 * <p>It also answers {@code hello} (the modern handshake) like {@code isMaster}.
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
