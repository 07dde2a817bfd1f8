package mongotx.testserver;

import java.util.ArrayList;
import java.util.Collection;
import java.util.List;

import de.bwaldvogel.mongo.backend.QueryResult;
import de.bwaldvogel.mongo.backend.memory.MemoryBackend;
import de.bwaldvogel.mongo.backend.memory.MemoryDatabase;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;
import de.bwaldvogel.mongo.exception.MongoServerException;
import de.bwaldvogel.mongo.wire.message.MongoQuery;
import io.netty.channel.Channel;

/**
 * mongo-java-server's in-memory backend, made to behave like the MongoDB version it announces
 * wherever mongotx depends on the server (see README, "The local test server").
 *
 * <p>Databases are {@link AtomicDatabase}s: single-document atomicity holds for readers (documents
 * leave a collection as copies taken under its lock), writes run as MongoDB runs them
 * ({@link Writes}: validators, one {@code $$NOW} per statement, pipeline updates, upsert seeding,
 * per-statement errors, the duplicate-key error's shape), and each collection may have a clock of
 * its own ({@link Clocks}).
 *
 * <p>The backend answers {@code hello} (the modern handshake) like {@code isMaster}, with
 * {@code localTime} from the default clock, and, playing 8.0, runs MongoDB 8.0's {@code bulkWrite}
 * (many writes on any collections in one message): each operation goes through this server's own
 * {@code insert}, {@code update} or {@code delete} handling, one at a time, so each keeps its
 * single-document atomicity, and the reply lists every operation's outcome as MongoDB 8.0 does.
 *
 * <p>Started with users ({@code --user}), every command goes through {@link Security} first:
 * authentication and the users' roles, as MongoDB enforces them. Without users nothing is checked,
 * and nothing differs from a server without this feature.
 */
final class AtomicBackend extends MemoryBackend {

    private final Profile profile;
    private final Clocks clocks;
    private final boolean prefilter;
    private final Security security;

    /**
     * {@code prefilter}: whether collections rule documents out with {@link Prefilter} first;
     * {@code security}: null when no users are given (no authentication).
     */
    AtomicBackend(Profile profile, Clocks clocks, boolean prefilter, Security security) {
        this.profile = profile;
        this.clocks = clocks;
        this.prefilter = prefilter;
        this.security = security;
    }

    @Override
    public MemoryDatabase openOrCreateDatabase(String databaseName) {
        return new AtomicDatabase(databaseName, getCursorRegistry(), profile, clocks, prefilter);
    }

    @Override
    public Document handleCommand(Channel channel, String databaseName, String command, Document query) {
        if (security != null) {
            return security.handle(channel, databaseName, command, query, this::run);
        }
        return run(channel, databaseName, command, query);
    }

    /** Runs a command the client may run. */
    private Document run(Channel channel, String databaseName, String command, Document query) {
        if (command.equalsIgnoreCase("hello") || command.equalsIgnoreCase("isMaster")) {
            Document response = super.handleCommand(channel, databaseName, "ismaster", query);
            if (command.equalsIgnoreCase("hello")) {
                response.remove("ismaster");
                response.put("isWritablePrimary", Boolean.TRUE);
            }
            response.put("localTime", clocks.serverTime());
            return response;
        }
        if (profile.runsBulkWrite() && command.equalsIgnoreCase("bulkWrite")) {
            return bulkWrite(channel, query);
        }
        if (security != null && command.equalsIgnoreCase("serverStatus")) {
            return super.getServerStatus(); // authorized; see getServerStatus()
        }
        return super.handleCommand(channel, databaseName, command, query);
    }

    /** The channel closed: with users, its authentication is forgotten. */
    @Override
    public void handleClose(Channel channel) {
        if (security != null) {
            security.forget(channel);
        }
        super.handleClose(channel);
    }

    /**
     * With users, legacy OP_QUERY reads are checked here, and so are the OP_QUERY commands
     * mongo-java-server answers without {@link #handleCommand} ({@code $cmd.sys.inprog} below,
     * {@code serverStatus} in {@link #getServerStatus}; {@code ping} needs nothing). A refusal there
     * is an exception, which closes the connection: no current driver sends these (MongoDB 6.0
     * refuses them all).
     */
    @Override
    public QueryResult handleQuery(MongoQuery query) {
        if (security != null) {
            security.checkLegacyQuery(query.getChannel(), query.getDatabaseName(), query.getCollectionName());
        }
        return super.handleQuery(query);
    }

    @Override
    public Collection<Document> getCurrentOperations(MongoQuery query) {
        if (security != null) {
            security.checkInprog(query.getChannel());
        }
        return super.getCurrentOperations(query);
    }

    /**
     * Reached with users only from an OP_QUERY {@code serverStatus}, which carries no connection to
     * check; an authorized OP_MSG {@code serverStatus} is answered by {@link #run} directly.
     */
    @Override
    public Document getServerStatus() {
        if (security != null) {
            throw new MongoServerError(13, "Unauthorized", "command serverStatus requires authentication");
        }
        return super.getServerStatus();
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
                Document command = single(kind, ns.substring(dot + 1), op);
                // The bulk's own options apply to each of its operations.
                for (String option : List.of("let", "bypassDocumentValidation")) {
                    if (query.containsKey(option)) {
                        command.put(option, query.get(option));
                    }
                }
                // Authorized already, for all the operations (Access.bulkWrite).
                Document reply = run(channel, ns.substring(0, dot), kind, command);
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
                for (String option : List.of("arrayFilters", "collation", "hint")) {
                    if (op.containsKey(option)) {
                        statement.append(option, op.get(option));
                    }
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
            Document outcome = new Document("ok", 0.0).append("code", error.get("code"))
                    .append("codeName", error.getOrDefault("codeName", "Location" + error.get("code")))
                    .append("errmsg", error.get("errmsg"));
            for (String detail : List.of("errInfo", "keyPattern", "keyValue")) {
                if (error.containsKey(detail)) {
                    outcome.put(detail, error.get(detail));
                }
            }
            return outcome.append("n", 0).append("nModified", 0);
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
}
