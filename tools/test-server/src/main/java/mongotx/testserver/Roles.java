package mongotx.testserver;

import java.util.ArrayList;
import java.util.Collection;
import java.util.List;
import java.util.Set;
import java.util.TreeSet;

import de.bwaldvogel.mongo.bson.Document;

/**
 * MongoDB's built-in roles as the privileges they grant, so that a user given with {@code --user}
 * may do on this server exactly what the same user may do on MongoDB (manual: "Built-In Roles",
 * "Privilege Actions"; the action lists follow the server's own role definitions).
 *
 * <p>A privilege is a set of actions on a resource: the cluster, a database, or one collection (a
 * namespace). A role grants actions on resource patterns: a role held on database D grants them on
 * D (the database itself and its normal collections, that is, all but {@code system.*}) and on a
 * few named system collections of D; the {@code ...AnyDatabase} roles and {@code root} are held on
 * {@code admin} only and reach every database ({@code local} and {@code config} excepted for the
 * {@code ...AnyDatabase} roles). {@code root} is modelled as every action on every resource, which
 * is what matters to a test: nothing is refused to it.
 *
 * <p>Supported: {@code read}, {@code readWrite}, {@code dbAdmin}, {@code userAdmin},
 * {@code dbOwner} (the three before it), {@code readAnyDatabase}, {@code readWriteAnyDatabase},
 * {@code dbAdminAnyDatabase} and {@code root}. The cluster roles ({@code clusterMonitor},
 * {@code clusterAdmin}, ...) and user-defined roles are not.
 */
final class Roles {

    private Roles() {
    }

    /**
     * What a privilege is about: the cluster ({@code db} null), a database ({@code collection}
     * null), or a namespace.
     */
    record Resource(String db, String collection) {

        static Resource cluster() {
            return new Resource(null, null);
        }

        static Resource database(String db) {
            return new Resource(db, null);
        }

        static Resource namespace(String db, String collection) {
            return new Resource(db, collection);
        }

        boolean isCluster() {
            return db == null;
        }

        boolean isDatabase() {
            return db != null && collection == null;
        }

        /**
         * A collection a database-wide grant covers: MongoDB keeps {@code system.*} collections (and
         * the {@code $cmd} pseudo-collections) out of them, so that {@code readWrite} on a database
         * does not reach, say, its {@code system.profile}.
         */
        boolean isNormal() {
            return collection == null || (!collection.startsWith("system.") && !collection.contains("$"));
        }

        @Override
        public String toString() {
            return isCluster() ? "the cluster" : isDatabase() ? db : db + "." + collection;
        }
    }

    /** How a grant names the resources it covers (MongoDB's resource pattern kinds). */
    enum Match {
        /** Every resource: {@code root} here. */
        ANY,
        /** The cluster. */
        CLUSTER,
        /** One database and its normal collections. */
        DATABASE,
        /** One namespace. */
        EXACT,
        /** Every database but {@code local} and {@code config}, with their normal collections. */
        ANY_NORMAL,
        /** The collection of one name in every database. */
        COLLECTION
    }

    /** One grant of a role: actions (null: every action) on the resources a pattern matches. */
    record Rule(Match match, String db, String collection, Set<String> actions) {

        boolean matches(Resource resource) {
            return switch (match) {
                case ANY -> true;
                case CLUSTER -> resource.isCluster();
                case DATABASE -> !resource.isCluster() && resource.db().equals(db) && resource.isNormal();
                case EXACT -> !resource.isCluster() && !resource.isDatabase() && resource.db().equals(db)
                        && resource.collection().equals(collection);
                case ANY_NORMAL -> !resource.isCluster() && resource.isNormal() && !resource.db().equals("local")
                        && !resource.db().equals("config");
                case COLLECTION -> !resource.isCluster() && !resource.isDatabase()
                        && resource.collection().equals(collection);
            };
        }

        boolean grants(String action) {
            return actions == null || actions.contains(action);
        }

        /** The grant as {@code connectionStatus} shows privileges ({@code showPrivileges: true}). */
        Document describe() {
            Document resource = switch (match) {
                case ANY -> new Document("anyResource", Boolean.TRUE);
                case CLUSTER -> new Document("cluster", Boolean.TRUE);
                case DATABASE -> new Document("db", db).append("collection", "");
                case EXACT -> new Document("db", db).append("collection", collection);
                case ANY_NORMAL -> new Document("db", "").append("collection", "");
                case COLLECTION -> new Document("db", "").append("collection", collection);
            };
            List<String> named = actions == null ? List.of("anyAction") : new ArrayList<>(new TreeSet<>(actions));
            return new Document("resource", resource).append("actions", named);
        }
    }

    /** What a user may do: the union of its roles' grants. */
    record Privileges(List<Rule> rules) {

        /** Whether every one of {@code actions} is granted on {@code resource} (by one grant or several). */
        boolean can(Resource resource, Collection<String> actions) {
            for (String action : actions) {
                boolean granted = false;
                for (Rule rule : rules) {
                    if (rule.matches(resource) && rule.grants(action)) {
                        granted = true;
                        break;
                    }
                }
                if (!granted) {
                    return false;
                }
            }
            return true;
        }

        boolean can(Resource resource, String action) {
            return can(resource, List.of(action));
        }

        /** Whether some action is granted on {@code resource}. */
        boolean canAnything(Resource resource) {
            return rules.stream().anyMatch(rule -> rule.matches(resource));
        }

        /**
         * Whether some grant names {@code db} itself or one of its collections: the databases
         * {@code listDatabases} shows a user without the {@code listDatabases} action.
         */
        boolean touches(String db) {
            return rules.stream().anyMatch(rule -> switch (rule.match()) {
                case ANY -> true;
                case DATABASE, EXACT -> rule.db().equals(db);
                case ANY_NORMAL -> !db.equals("local") && !db.equals("config");
                default -> false;
            });
        }

        /** Whether nothing is refused (root). */
        boolean unrestricted() {
            return rules.stream().anyMatch(rule -> rule.match() == Match.ANY && rule.actions() == null);
        }
    }

    private static Set<String> actions(Collection<String> base, String... more) {
        Set<String> all = new TreeSet<>(base);
        all.addAll(List.of(more));
        return Set.copyOf(all);
    }

    static final Set<String> READ = Set.of("changeStream", "collStats", "dbHash", "dbStats", "find", "killCursors",
            "listCollections", "listIndexes", "listSearchIndexes", "planCacheRead");

    static final Set<String> READ_WRITE = actions(READ, "cleanupStructuredEncryptionData",
            "compactStructuredEncryptionData", "convertToCapped", "createCollection", "createIndex",
            "createSearchIndexes", "dropCollection", "dropIndex", "dropSearchIndex", "insert", "remove",
            "renameCollectionSameDB", "update", "updateSearchIndex");

    /** Note what is missing: {@code find}, {@code insert}, {@code update}, {@code remove}. */
    static final Set<String> DB_ADMIN = Set.of("analyze", "bypassDocumentValidation", "collMod", "collStats",
            "compact", "convertToCapped", "createCollection", "dbStats", "dropCollection", "dropDatabase", "dropIndex",
            "dropSearchIndex", "createIndex", "createSearchIndexes", "enableProfiler", "listCollections", "listIndexes",
            "listSearchIndexes", "updateSearchIndex", "planCacheIndexFilter", "planCacheRead", "planCacheWrite",
            "reIndex", "renameCollectionSameDB", "storageDetails", "validate", "configureQueryAnalyzer");

    /** {@code dbAdmin} may read and reshape its database's profiler collection. */
    private static final Set<String> PROFILE = actions(READ, "convertToCapped", "createCollection", "dropCollection");

    static final Set<String> USER_ADMIN = Set.of("changeCustomData", "changePassword", "createUser", "createRole",
            "dropUser", "dropRole", "grantRole", "revokeRole", "setAuthenticationRestriction", "viewUser", "viewRole");

    /** The roles this server knows. */
    static final Set<String> NAMES = Set.of("read", "readWrite", "dbAdmin", "userAdmin", "dbOwner", "readAnyDatabase",
            "readWriteAnyDatabase", "dbAdminAnyDatabase", "root");

    /** Roles that exist only on {@code admin} (MongoDB knows no {@code root@shop}). */
    static boolean adminOnly(String role) {
        return role.endsWith("AnyDatabase") || role.equals("root");
    }

    /** The grants of {@code role} held on {@code db}; the role is one of {@link #NAMES}. */
    static List<Rule> grants(String role, String db) {
        List<Rule> rules = new ArrayList<>();
        switch (role) {
            case "read" -> {
                rules.add(new Rule(Match.DATABASE, db, null, READ));
                rules.add(new Rule(Match.EXACT, db, "system.js", READ));
            }
            case "readWrite" -> {
                rules.add(new Rule(Match.DATABASE, db, null, READ_WRITE));
                rules.add(new Rule(Match.EXACT, db, "system.js", READ_WRITE));
            }
            case "dbAdmin" -> {
                rules.add(new Rule(Match.DATABASE, db, null, DB_ADMIN));
                rules.add(new Rule(Match.EXACT, db, "system.profile", PROFILE));
            }
            case "userAdmin" -> rules.add(new Rule(Match.DATABASE, db, null, USER_ADMIN));
            case "dbOwner" -> {
                rules.addAll(grants("readWrite", db));
                rules.addAll(grants("dbAdmin", db));
                rules.addAll(grants("userAdmin", db));
            }
            case "readAnyDatabase" -> {
                rules.add(new Rule(Match.ANY_NORMAL, null, null, READ));
                rules.add(new Rule(Match.CLUSTER, null, null, Set.of("listDatabases")));
                rules.add(new Rule(Match.COLLECTION, null, "system.js", READ));
            }
            case "readWriteAnyDatabase" -> {
                rules.addAll(grants("readAnyDatabase", db));
                rules.add(new Rule(Match.ANY_NORMAL, null, null, READ_WRITE));
                rules.add(new Rule(Match.COLLECTION, null, "system.js", READ_WRITE));
            }
            case "dbAdminAnyDatabase" -> {
                rules.add(new Rule(Match.CLUSTER, null, null, Set.of("listDatabases", "applyOps")));
                rules.add(new Rule(Match.ANY_NORMAL, null, null, DB_ADMIN));
                rules.add(new Rule(Match.COLLECTION, null, "system.profile", PROFILE));
            }
            case "root" -> rules.add(new Rule(Match.ANY, null, null, null));
            default -> throw new IllegalArgumentException("No role named " + role + "@" + db);
        }
        return rules;
    }
}
