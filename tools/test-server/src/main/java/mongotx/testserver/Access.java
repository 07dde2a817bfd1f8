package mongotx.testserver;

import java.util.ArrayList;
import java.util.List;
import java.util.Locale;
import java.util.Set;
import java.util.TreeSet;
import java.util.function.Predicate;

import de.bwaldvogel.mongo.bson.Document;
import mongotx.testserver.Roles.Privileges;
import mongotx.testserver.Roles.Resource;

/**
 * What each command needs once authentication is on, as MongoDB decides it: the privileges
 * (actions on resources) its authorization check asks of the user, following the server's checks
 * command by command (find, the write commands, aggregate stage by stage, create, renameCollection,
 * bulkWrite...). Some commands run before authentication ({@link Need#OPEN}: the handshake and
 * authentication itself), some ask only that the client be authenticated ({@link Need#AUTHENTICATED}:
 * cursors and sessions are checked against their owner instead).
 *
 * <p>A command this table does not know needs {@code root}: were a command added to the server
 * later, it stays closed to the roles until someone decides what it needs, rather than open to
 * everyone by accident.
 */
final class Access {

    private Access() {
    }

    /**
     * What a command needs: nothing ({@code open}: it runs before authentication), or an
     * authenticated user whose privileges pass {@code test}.
     */
    record Need(boolean open, Predicate<Privileges> test) {

        static final Need OPEN = new Need(true, p -> true);
        static final Need AUTHENTICATED = new Need(false, p -> true);
        static final Need ROOT = new Need(false, Privileges::unrestricted);

        static Need all(List<Privilege> privileges) {
            List<Privilege> required = List.copyOf(privileges);
            return new Need(false, p -> required.stream().allMatch(r -> p.can(r.resource(), r.actions())));
        }

        Need and(Need other) {
            return new Need(false, p -> test.test(p) && other.test.test(p));
        }

        Need or(Need other) {
            return new Need(false, p -> test.test(p) || other.test.test(p));
        }

        boolean allows(Privileges privileges) {
            return test.test(privileges);
        }
    }

    /** Actions on one resource. */
    record Privilege(Resource resource, Set<String> actions) {
    }

    private static Need on(Resource resource, String... actions) {
        return Need.all(List.of(new Privilege(resource, Set.of(actions))));
    }

    /** The commands that run before authentication (MongoDB's {@code requiresAuth() == false}). */
    private static final Set<String> OPEN = Set.of("hello", "ismaster", "saslstart", "saslcontinue", "authenticate",
            "logout", "ping", "buildinfo", "getnonce", "endsessions", "connectionstatus", "whatsmyuri");

    /**
     * The commands any authenticated user may run: cursors ({@code getMore}, {@code killCursors}) are
     * checked against the user that opened them, {@code listDatabases} shows each user the databases
     * it has privileges on, and sessions and transactions belong to whoever started them.
     */
    private static final Set<String> AUTHENTICATED = Set.of("getmore", "killcursors", "listdatabases", "getlasterror",
            "reseterror", "committransaction", "aborttransaction", "startsession", "refreshsessions", "killsessions");

    /** What running {@code command} (its first key, as sent) on {@code db} needs. */
    static Need of(String db, String command, Document query) {
        String name = command.toLowerCase(Locale.ROOT);
        if (OPEN.contains(name)) {
            return Need.OPEN;
        }
        if (AUTHENTICATED.contains(name)) {
            return Need.AUTHENTICATED;
        }
        Resource target = target(db, query.get(command));
        boolean bypass = truthy(query.get("bypassDocumentValidation"));
        return switch (name) {
            case "find", "count", "distinct" -> on(target, "find");
            case "listindexes" -> on(target, "listIndexes");
            case "collstats" -> on(target, "collStats");
            case "validate" -> on(target, "validate");
            case "dbstats" -> on(Resource.database(db), "dbStats");
            // With authorizedCollections and nameOnly, a user without the action still lists the
            // collections it has privileges on (the reply is filtered).
            case "listcollections" -> truthy(query.get("authorizedCollections")) && truthy(query.get("nameOnly"))
                    ? Need.AUTHENTICATED
                    : on(Resource.database(db), "listCollections");
            case "insert" -> bypass ? on(target, "insert", "bypassDocumentValidation") : on(target, "insert");
            case "update" -> update(target, query, bypass);
            case "delete" -> on(target, "remove");
            case "findandmodify" -> findAndModify(target, query, bypass);
            case "create" -> create(db, target, query);
            case "createindexes" -> on(target, "createIndex");
            case "dropindexes", "deleteindexes" -> on(target, "dropIndex");
            case "drop" -> on(target, "dropCollection");
            case "dropdatabase" -> on(Resource.database(db), "dropDatabase");
            case "collmod" -> on(target, "collMod");
            case "converttocapped" -> on(target, "convertToCapped");
            case "renamecollection" -> rename(query);
            case "aggregate" -> Need.all(aggregate(db, target, query.get("pipeline"), bypass));
            case "explain" -> query.get(command) instanceof Document explained && !explained.isEmpty()
                    ? of(db, explained.keySet().iterator().next(), explained)
                    : Need.ROOT;
            case "bulkwrite" -> bulkWrite(query, bypass);
            case "serverstatus" -> on(Resource.cluster(), "serverStatus");
            case "hostinfo" -> on(Resource.cluster(), "hostInfo");
            case "getcmdlineopts" -> on(Resource.cluster(), "getCmdLineOpts");
            case "getlog" -> on(Resource.cluster(), "getLog");
            case "replsetgetstatus" -> on(Resource.cluster(), "replSetGetStatus");
            case "getfreemonitoringstatus" -> on(Resource.cluster(), "checkFreeMonitoringStatus");
            case "currentop" -> on(Resource.cluster(), "inprog");
            default -> Need.ROOT;
        };
    }

    /** The collection a command names (its first value), or its database when it names none. */
    private static Resource target(String db, Object value) {
        return value instanceof String collection ? Resource.namespace(db, collection) : Resource.database(db);
    }

    private static boolean truthy(Object value) {
        return Boolean.TRUE.equals(value) || (value instanceof Number n && n.doubleValue() != 0);
    }

    /** {@code update}: an upsert may insert; bypassing validation is an action of its own. */
    private static Need update(Resource target, Document query, boolean bypass) {
        Set<String> actions = new TreeSet<>(List.of("update"));
        if (query.get("updates") instanceof List<?> statements) {
            for (Object statement : statements) {
                if (statement instanceof Document s && truthy(s.get("upsert"))) {
                    actions.add("insert");
                }
            }
        }
        if (bypass) {
            actions.add("bypassDocumentValidation");
        }
        return Need.all(List.of(new Privilege(target, actions)));
    }

    /** {@code findAndModify}: it reads, then removes or updates (and upserts). */
    private static Need findAndModify(Resource target, Document query, boolean bypass) {
        Set<String> actions = new TreeSet<>(List.of("find"));
        if (truthy(query.get("remove"))) {
            actions.add("remove");
        }
        if (query.containsKey("update")) {
            actions.add("update");
        }
        if (truthy(query.get("upsert"))) {
            actions.add("insert");
        }
        if (bypass) {
            actions.add("bypassDocumentValidation");
        }
        return Need.all(List.of(new Privilege(target, actions)));
    }

    /**
     * {@code create}: {@code createCollection} or {@code insert} for a collection (a validator needs
     * nothing more), {@code convertToCapped} too for a capped one; a view needs
     * {@code createCollection}, and, if the user may read the view, the privileges of the view's
     * pipeline on its source (so a view cannot show what its creator may not read).
     */
    private static Need create(String db, Resource target, Document query) {
        Need need;
        if (query.get("viewOn") instanceof String source) {
            List<Privilege> pipeline = aggregate(db, Resource.namespace(db, source), query.get("pipeline"), false);
            Need readable = on(target, "find");
            need = on(target, "createCollection")
                    .and(new Need(false, p -> !readable.allows(p) || Need.all(pipeline).allows(p)));
        } else {
            need = on(target, "createCollection").or(on(target, "insert"));
        }
        return truthy(query.get("capped")) ? need.and(on(target, "convertToCapped")) : need;
    }

    /**
     * {@code renameCollection} (on admin, with full namespaces): within one database, either
     * {@code renameCollectionSameDB} on it (plus {@code dropCollection} on the target with
     * {@code dropTarget}, and, if the user may read the source, reading the target too); or, as
     * across databases, reading and dropping the source and inserting into and indexing the target.
     */
    private static Need rename(Document query) {
        Resource source = namespace(query.get("renameCollection"));
        Resource target = namespace(query.get("to"));
        if (source == null || target == null) {
            return Need.ROOT;
        }
        boolean dropTarget = truthy(query.get("dropTarget"));
        List<Privilege> general = new ArrayList<>();
        general.add(new Privilege(source, Set.of("find", "dropCollection")));
        general.add(new Privilege(target, dropTarget ? Set.of("insert", "createIndex", "dropCollection")
                : Set.of("insert", "createIndex")));
        Need across = Need.all(general);
        if (!source.db().equals(target.db()) || !source.isNormal() || !target.isNormal()) {
            return across;
        }
        Need sameDb = new Need(false, p -> p.can(Resource.database(source.db()), "renameCollectionSameDB")
                && (!dropTarget || p.can(target, "dropCollection"))
                && (p.can(target, "find") || !p.can(source, "find")));
        return sameDb.or(across);
    }

    private static Resource namespace(Object value) {
        if (value instanceof String ns) {
            int dot = ns.indexOf('.');
            if (dot > 0 && dot < ns.length() - 1) {
                return Resource.namespace(ns.substring(0, dot), ns.substring(dot + 1));
            }
        }
        return null;
    }

    /** Stages that produce documents themselves rather than read the collection the command names. */
    private static final Set<String> INITIAL_SOURCES = Set.of("$documents", "$currentOp", "$listLocalSessions",
            "$listSessions", "$changeStream", "$collStats", "$indexStats", "$planCacheStats", "$listCatalog",
            "$listSearchIndexes", "$queryStats", "$shardedDataDistribution", "$listSampledQueries",
            "$listClusterCatalog");

    /**
     * The privileges a pipeline on {@code source} (a namespace, or the database for
     * {@code aggregate: 1}) needs: {@code find} on the source unless the first stage produces its own
     * documents, then what each stage needs: {@code $out} and {@code $merge} write their target
     * ({@code bypassDocumentValidation} only matters to them), {@code $lookup},
     * {@code $graphLookup} and {@code $unionWith} read theirs, sub-pipelines count too.
     */
    private static List<Privilege> aggregate(String db, Resource source, Object pipeline, boolean bypass) {
        List<Privilege> needed = new ArrayList<>();
        List<?> stages = pipeline instanceof List<?> list ? list : List.of();
        boolean initial = !stages.isEmpty() && stages.get(0) instanceof Document first && !first.isEmpty()
                && INITIAL_SOURCES.contains(first.keySet().iterator().next());
        if (!initial && !source.isDatabase()) {
            needed.add(new Privilege(source, Set.of("find")));
        }
        for (Object stage : stages) {
            if (stage instanceof Document d && !d.isEmpty()) {
                String name = d.keySet().iterator().next();
                stage(db, source, name, d.get(name), bypass, needed);
            }
        }
        return needed;
    }

    private static void stage(String db, Resource source, String name, Object spec, boolean bypass,
            List<Privilege> needed) {
        switch (name) {
            case "$out" -> {
                Resource into = spec instanceof Document d ? foreign(db, d.get("db"), d.get("coll")) : foreign(db, null, spec);
                if (into != null) {
                    needed.add(new Privilege(into, writing(bypass, "insert", "remove")));
                }
            }
            case "$merge" -> {
                Object into = spec instanceof Document d ? d.get("into") : spec;
                Resource target = into instanceof Document d ? foreign(db, d.get("db"), d.get("coll")) : foreign(db, null, into);
                Document options = spec instanceof Document d ? d : new Document();
                List<String> actions = new ArrayList<>();
                Object notMatched = options.getOrDefault("whenNotMatched", "insert");
                if (!"discard".equals(notMatched) && !"fail".equals(notMatched)) {
                    actions.add("insert");
                }
                if (!"fail".equals(options.getOrDefault("whenMatched", "merge"))) {
                    actions.add("update");
                }
                if (target != null) {
                    needed.add(new Privilege(target, writing(bypass, actions.toArray(String[]::new))));
                }
            }
            case "$lookup", "$unionWith" -> {
                Object from = spec instanceof Document d ? d.get(name.equals("$lookup") ? "from" : "coll") : spec;
                Resource foreign = from instanceof Document d ? foreign(db, d.get("db"), d.get("coll")) : foreign(db, null, from);
                if (foreign != null) {
                    needed.add(new Privilege(foreign, Set.of("find")));
                }
                if (spec instanceof Document d && d.get("pipeline") instanceof List<?> sub) {
                    needed.addAll(aggregate(db, foreign != null ? foreign : Resource.database(db), sub, bypass));
                }
            }
            case "$graphLookup" -> {
                Resource foreign = spec instanceof Document d ? foreign(db, null, d.get("from")) : null;
                if (foreign != null) {
                    needed.add(new Privilege(foreign, Set.of("find")));
                }
            }
            case "$facet" -> {
                if (spec instanceof Document facets) {
                    for (Object sub : facets.values()) {
                        needed.addAll(aggregate(db, Resource.database(db), sub, bypass));
                    }
                }
            }
            case "$collStats" -> needed.add(new Privilege(source, Set.of("collStats")));
            case "$indexStats" -> needed.add(new Privilege(source, Set.of("indexStats")));
            case "$planCacheStats" -> needed.add(new Privilege(source, Set.of("planCacheRead")));
            case "$changeStream" -> needed.add(new Privilege(source, Set.of("changeStream", "find")));
            case "$currentOp" -> {
                if (spec instanceof Document d && truthy(d.get("allUsers"))) {
                    needed.add(new Privilege(Resource.cluster(), Set.of("inprog")));
                }
            }
            case "$listSessions", "$listLocalSessions" -> {
                if (spec instanceof Document d && truthy(d.get("allUsers"))) {
                    needed.add(new Privilege(Resource.cluster(), Set.of("listSessions")));
                }
            }
            default -> {
                // Other stages work on the documents the pipeline already has.
            }
        }
    }

    private static Set<String> writing(boolean bypass, String... actions) {
        Set<String> all = new TreeSet<>(List.of(actions));
        if (bypass) {
            all.add("bypassDocumentValidation");
        }
        return all;
    }

    /** The namespace a stage names ({@code coll} in {@code db}, by default the command's database). */
    private static Resource foreign(String db, Object otherDb, Object collection) {
        if (!(collection instanceof String name)) {
            return null;
        }
        return Resource.namespace(otherDb instanceof String other ? other : db, name);
    }

    /**
     * MongoDB 8.0's {@code bulkWrite} (run on admin): each operation needs its action on the
     * namespace it names in {@code nsInfo}: {@code insert}, {@code update} ({@code insert} too for an
     * upsert) or {@code remove}; all are checked before any runs.
     */
    private static Need bulkWrite(Document query, boolean bypass) {
        List<?> ops = query.get("ops") instanceof List<?> list ? list : List.of();
        List<?> namespaces = query.get("nsInfo") instanceof List<?> list ? list : List.of();
        List<Privilege> needed = new ArrayList<>();
        for (Object item : ops) {
            if (!(item instanceof Document op)) {
                continue;
            }
            String kind = op.containsKey("insert") ? "insert" : op.containsKey("update") ? "update" : "delete";
            if (!(op.get(kind) instanceof Number n) || n.intValue() < 0 || n.intValue() >= namespaces.size()
                    || !(namespaces.get(n.intValue()) instanceof Document info)) {
                continue; // the operation fails on its own
            }
            Resource ns = namespace(info.get("ns"));
            if (ns == null) {
                continue;
            }
            List<String> actions = new ArrayList<>();
            switch (kind) {
                case "insert" -> actions.add("insert");
                case "update" -> {
                    actions.add("update");
                    if (truthy(op.get("upsert"))) {
                        actions.add("insert");
                    }
                }
                default -> actions.add("remove");
            }
            needed.add(new Privilege(ns, writing(bypass, actions.toArray(String[]::new))));
        }
        return Need.all(needed);
    }
}
