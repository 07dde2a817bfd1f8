package mongotx.testserver;

import java.nio.charset.StandardCharsets;
import java.security.SecureRandom;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Locale;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.function.Supplier;

import de.bwaldvogel.mongo.bson.BinData;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;
import io.netty.channel.Channel;
import mongotx.testserver.Roles.Resource;
import mongotx.testserver.Users.User;

/**
 * Authentication and authorization, on when the server is started with {@code --user}: every
 * command passes here first, and a client must authenticate (SCRAM-SHA-256 against {@code admin})
 * before anything but the handshake, then may run only what its roles allow on the command's
 * database ({@link Access}, {@link Roles}), with MongoDB's answers when it may not: code 13
 * {@code Unauthorized}, "command find requires authentication" before authentication and "not
 * authorized on shop to execute command { collMod: ... }" after, and code 18
 * {@code AuthenticationFailed}, "Authentication failed." (whatever the reason) for a failed
 * authentication.
 *
 * <p>Authentication is per connection, as in MongoDB: the state lives with the netty channel and is
 * forgotten when the channel closes. Authentication runs the way drivers run it:
 * {@code saslStart} then {@code saslContinue}, with or without the final empty exchange
 * ({@code options.skipEmptyExchange}), or begun inside the handshake ({@code hello}'s
 * {@code speculativeAuthenticate}, answered with the server's first message) and finished with
 * {@code saslContinue}; {@code hello} with {@code saslSupportedMechs: "admin.<user>"} lists
 * SCRAM-SHA-256 for a user that exists. Only SCRAM-SHA-256 is offered (MongoDB with
 * {@code authenticationMechanisms=SCRAM-SHA-256}).
 *
 * <p>Cursors belong to the user that opened them ({@code getMore} and {@code killCursors} on
 * another user's cursor are refused, unless by root); {@code listDatabases} shows a user without
 * the {@code listDatabases} action only the databases it holds privileges on;
 * {@code connectionStatus} reports the authenticated user and its roles.
 */
final class Security {

    /** How a refused command is answered (the channel stays open). */
    private static final class Refusal extends RuntimeException {
        private static final long serialVersionUID = 1L;
        final int code;
        final String codeName;

        Refusal(int code, String codeName, String message) {
            super(message, null, false, false);
            this.code = code;
            this.codeName = codeName;
        }

        Document reply() {
            return new Document("ok", 0.0).append("errmsg", getMessage()).append("code", code)
                    .append("codeName", codeName);
        }
    }

    private static Refusal unauthorized(String message) {
        return new Refusal(13, "Unauthorized", message);
    }

    private static Refusal authenticationFailed() {
        return new Refusal(18, "AuthenticationFailed", "Authentication failed.");
    }

    /** The command that actually runs it: {@link AtomicBackend}'s own handling. */
    interface Runner {
        Document run(Channel channel, String db, String command, Document query);
    }

    /** One SASL conversation of a connection. */
    private static final class Conversation {
        final User user;
        final Scram.Conversation scram;
        final boolean skipEmptyExchange;
        boolean proven;

        Conversation(User user, Scram.Conversation scram, boolean skipEmptyExchange) {
            this.user = user;
            this.scram = scram;
            this.skipEmptyExchange = skipEmptyExchange;
        }
    }

    /** A connection: who it is authenticated as (null: nobody yet), and its SASL conversations. */
    private static final class Session {
        User user;
        final Map<Integer, Conversation> conversations = new HashMap<>();
        int lastConversationId;
    }

    private final Users users;
    private final SecureRandom random = new SecureRandom();
    private final Map<Channel, Session> sessions = new ConcurrentHashMap<>();
    /** Cursor id to the name of the user that opened it. */
    private final Map<Long, String> cursorOwners = new ConcurrentHashMap<>();

    Security(Users users) {
        this.users = users;
    }

    /** The channel closed: its authentication ends with it. */
    void forget(Channel channel) {
        sessions.remove(channel);
    }

    private Session session(Channel channel) {
        return sessions.computeIfAbsent(channel, c -> new Session());
    }

    /**
     * Runs {@code command} through {@code next} if the connection may run it; otherwise answers
     * with the refusal. Errors of the command itself pass through untouched.
     */
    Document handle(Channel channel, String db, String command, Document query, Runner next) {
        Session session = session(channel);
        synchronized (session) {
            try {
                return handle(session, channel, db, command, query, next);
            } catch (Refusal refusal) {
                return refusal.reply();
            }
        }
    }

    private Document handle(Session session, Channel channel, String db, String command, Document query,
            Runner next) {
        String name = command.toLowerCase(Locale.ROOT);
        switch (name) {
            case "saslstart":
                return saslStart(session, db, query);
            case "saslcontinue":
                return saslContinue(session, query);
            case "hello":
            case "ismaster":
                return hello(session, db, query, next.run(channel, db, command, query));
            case "logout":
                session.user = null;
                session.conversations.clear();
                return new Document("ok", 1.0);
            case "connectionstatus":
                return connectionStatus(session.user, query);
            case "authenticate":
                throw new Refusal(334, "MechanismUnavailable", "Received authentication for mechanism "
                        + query.get("mechanism") + " which is not enabled");
            default:
                break;
        }
        Access.Need need = Access.of(db, command, query);
        if (need.open()) {
            return next.run(channel, db, command, query);
        }
        User user = session.user;
        if (user == null) {
            throw unauthorized("command " + command + " requires authentication");
        }
        if (!need.allows(user.privileges())) {
            throw unauthorized("not authorized on " + db + " to execute command " + abbreviated(query));
        }
        if (name.equals("getmore")) {
            checkOwner(user, query.get(command), () -> unauthorized("cursor id " + query.get(command)
                    + " was not created by the authenticated user"));
        } else if (name.equals("killcursors") && query.get("cursors") instanceof List<?> cursors) {
            for (Object id : cursors) {
                checkOwner(user, id, () -> unauthorized("not authorized to kill cursor on " + db + "."
                        + query.get(command)));
            }
        } else if (name.equals("listdatabases") && Boolean.FALSE.equals(query.get("authorizedDatabases"))
                && !user.privileges().can(Resource.cluster(), "listDatabases")) {
            throw unauthorized("not authorized on " + db + " to execute command " + abbreviated(query));
        }
        Document reply = next.run(channel, db, command, query);
        afterwards(user, db, name, command, query, reply);
        return reply;
    }

    private void checkOwner(User user, Object id, Supplier<Refusal> refusal) {
        if (id instanceof Number n) {
            String owner = cursorOwners.get(n.longValue());
            if (owner != null && !owner.equals(user.name()) && !user.privileges().unrestricted()) {
                throw refusal.get();
            }
        }
    }

    /** Keeps track of cursors' owners, and trims what a user may not see from listings. */
    private void afterwards(User user, String db, String name, String command, Document query, Document reply) {
        if (reply.get("cursor") instanceof Document cursor && cursor.get("id") instanceof Number id) {
            if (name.equals("getmore")) {
                // Root may read on from another user's cursor, which stays that user's.
                if (id.longValue() == 0 && query.get(command) instanceof Number exhausted) {
                    cursorOwners.remove(exhausted.longValue());
                }
            } else if (id.longValue() != 0) {
                cursorOwners.put(id.longValue(), user.name());
            }
            if (name.equals("listcollections") && !user.privileges().can(Resource.database(db), "listCollections")
                    && cursor.get("firstBatch") instanceof List<?> batch) {
                List<Object> visible = new ArrayList<>();
                for (Object entry : batch) {
                    if (entry instanceof Document d && d.get("name") instanceof String collection
                            && user.privileges().canAnything(Resource.namespace(db, collection))) {
                        visible.add(entry);
                    }
                }
                cursor.put("firstBatch", visible);
            }
        }
        if (name.equals("killcursors") && query.get("cursors") instanceof List<?> cursors) {
            for (Object id : cursors) {
                if (id instanceof Number n) {
                    cursorOwners.remove(n.longValue());
                }
            }
        }
        if (name.equals("listdatabases") && !user.privileges().can(Resource.cluster(), "listDatabases")
                && reply.get("databases") instanceof List<?> databases) {
            List<Object> visible = new ArrayList<>();
            for (Object entry : databases) {
                if (entry instanceof Document d && d.get("name") instanceof String database
                        && user.privileges().touches(database)) {
                    visible.add(entry);
                }
            }
            reply.put("databases", visible);
        }
    }

    /**
     * {@code hello}/{@code isMaster}: the mechanisms of the user named in {@code saslSupportedMechs}
     * (left out if there is no such user, as MongoDB does), and the first step of a speculative
     * authentication. A speculative start that fails is left out of the reply: the driver then
     * authenticates with {@code saslStart} and hears the error there.
     */
    private Document hello(Session session, String db, Document query, Document reply) {
        if (query.get("saslSupportedMechs") instanceof String qualified) {
            int dot = qualified.indexOf('.');
            if (dot > 0 && users.find(qualified.substring(0, dot), qualified.substring(dot + 1)) != null) {
                reply.put("saslSupportedMechs", List.of(Scram.MECHANISM));
            }
        }
        if (query.get("speculativeAuthenticate") instanceof Document speculative
                && speculative.containsKey("saslStart")) {
            String authDb = speculative.get("db") instanceof String s ? s : db;
            try {
                Document started = saslStart(session, authDb, speculative);
                started.remove("ok");
                reply.put("speculativeAuthenticate", started);
            } catch (Refusal refused) {
                // Left out: the driver falls back to saslStart.
            }
        }
        return reply;
    }

    private Document saslStart(Session session, String db, Document query) {
        Object mechanism = query.get("mechanism");
        if (!Scram.MECHANISM.equals(mechanism)) {
            throw new Refusal(334, "MechanismUnavailable", "Received authentication for mechanism " + mechanism
                    + " which is not enabled");
        }
        Scram.ClientFirst first;
        try {
            first = Scram.ClientFirst.parse(payload(query));
        } catch (Scram.Failure e) {
            throw authenticationFailed();
        }
        User user = users.find(db, first.user());
        if (user == null) {
            throw authenticationFailed();
        }
        if (session.user != null && !session.user.name().equals(user.name())) {
            throw new Refusal(5626701, "Location5626701",
                    "Each client connection may only be authenticated once. Previously authenticated as: "
                            + session.user.name() + "@" + Users.DB);
        }
        boolean skip = query.get("options") instanceof Document options
                && Boolean.TRUE.equals(options.get("skipEmptyExchange"));
        Scram.Conversation scram = new Scram.Conversation(first, user.credentials(), random);
        int id = ++session.lastConversationId;
        session.conversations.put(id, new Conversation(user, scram, skip));
        return new Document("conversationId", id).append("done", Boolean.FALSE)
                .append("payload", new BinData(scram.serverFirst())).append("ok", 1.0);
    }

    private Document saslContinue(Session session, Document query) {
        Object id = query.get("conversationId");
        Conversation conversation = id instanceof Number n ? session.conversations.get(n.intValue()) : null;
        if (conversation == null) {
            throw new Refusal(17, "ProtocolError", "No SASL session state found");
        }
        int conversationId = ((Number) id).intValue();
        Document reply = new Document("conversationId", conversationId);
        if (conversation.proven) {
            // The final empty exchange of a client that did not ask to skip it.
            session.conversations.remove(conversationId);
            return reply.append("done", Boolean.TRUE).append("payload", new BinData(new byte[0])).append("ok", 1.0);
        }
        byte[] serverFinal;
        try {
            serverFinal = conversation.scram.finish(payload(query));
        } catch (Scram.Failure e) {
            session.conversations.remove(conversationId);
            throw authenticationFailed();
        }
        session.user = conversation.user;
        conversation.proven = true;
        if (conversation.skipEmptyExchange) {
            session.conversations.remove(conversationId);
        }
        return reply.append("done", conversation.skipEmptyExchange).append("payload", new BinData(serverFinal))
                .append("ok", 1.0);
    }

    private static byte[] payload(Document query) {
        Object payload = query.get("payload");
        if (payload instanceof BinData data) {
            return data.getData();
        }
        if (payload instanceof String text) {
            return text.getBytes(StandardCharsets.UTF_8);
        }
        return new byte[0];
    }

    /** {@code connectionStatus}, which MongoDB answers before authentication too. */
    private static Document connectionStatus(User user, Document query) {
        List<Document> names = new ArrayList<>();
        List<Document> roles = new ArrayList<>();
        List<Document> privileges = new ArrayList<>();
        if (user != null) {
            names.add(new Document("user", user.name()).append("db", Users.DB));
            for (Users.Grant grant : user.grants()) {
                roles.add(new Document("role", grant.role()).append("db", grant.db()));
            }
            for (Roles.Rule rule : user.privileges().rules()) {
                privileges.add(rule.describe());
            }
        }
        Document info = new Document("authenticatedUsers", names).append("authenticatedUserRoles", roles);
        if (Boolean.TRUE.equals(query.get("showPrivileges"))) {
            info.append("authenticatedUserPrivileges", privileges);
        }
        return new Document("authInfo", info).append("ok", 1.0);
    }

    /**
     * Checks a legacy OP_QUERY read (no driver of this century sends one; MongoDB 6.0 refuses them
     * outright): it needs what {@code find} needs.
     */
    void checkLegacyQuery(Channel channel, String db, String collection) {
        User user = session(channel).user;
        if (user == null) {
            throw new MongoServerError(13, "Unauthorized", "command find requires authentication");
        }
        if (!user.privileges().can(Resource.namespace(db, collection), "find")) {
            throw new MongoServerError(13, "Unauthorized", "not authorized for query on " + db + "." + collection);
        }
    }

    /** Checks a legacy OP_QUERY on {@code $cmd.sys.inprog}: the {@code inprog} action. */
    void checkInprog(Channel channel) {
        User user = session(channel).user;
        if (user == null || !user.privileges().can(Resource.cluster(), "inprog")) {
            throw new MongoServerError(13, "Unauthorized", "not authorized on admin to execute command { currentOp: 1 }");
        }
    }

    /**
     * The command as the error message shows it: top-level fields, with nested documents and arrays
     * abbreviated (MongoDB prints the whole command; the shape is the same).
     */
    static String abbreviated(Document query) {
        StringBuilder text = new StringBuilder("{ ");
        boolean first = true;
        for (Map.Entry<String, Object> entry : query.entrySet()) {
            if (!first) {
                text.append(", ");
            }
            first = false;
            text.append(entry.getKey()).append(": ");
            Object value = entry.getValue();
            if (value instanceof String s) {
                text.append('"').append(s).append('"');
            } else if (value instanceof Document d) {
                text.append(d.isEmpty() ? "{}" : "{ ... }");
            } else if (value instanceof List<?> l) {
                text.append(l.isEmpty() ? "[]" : "[ ... ]");
            } else if (value instanceof BinData) {
                text.append("BinData(...)");
            } else {
                text.append(value);
            }
        }
        return text.append(" }").toString();
    }
}
