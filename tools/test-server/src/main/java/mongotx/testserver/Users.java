package mongotx.testserver;

import java.security.SecureRandom;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeSet;

/**
 * The users given with {@code --user NAME:PASSWORD:ROLE@DB[+ROLE@DB...]}, all defined on the
 * {@code admin} database (clients authenticate with {@code authSource=admin}), as
 * {@code db.getSiblingDB("admin").createUser({user, pwd, roles: [{role, db}, ...]})} defines them
 * on MongoDB. Each role is held on its own database only ({@code readWrite@shop} reaches nothing
 * outside {@code shop}); {@code root} and the {@code ...AnyDatabase} roles exist on {@code admin}
 * only, as in MongoDB.
 */
final class Users {

    /** The database every user is defined on. */
    static final String DB = "admin";

    /** One role held on one database. */
    record Grant(String role, String db) {

        @Override
        public String toString() {
            return role + "@" + db;
        }
    }

    /** A user: its name, its roles, what the server keeps of its password, and what it may do. */
    record User(String name, List<Grant> grants, Scram.Credentials credentials, Roles.Privileges privileges) {
    }

    private final Map<String, User> users;

    private Users(Map<String, User> users) {
        this.users = users;
    }

    /**
     * Parses the {@code --user} arguments. The name runs to the first colon and the roles follow the
     * last one, so a password may hold colons; it must be printable ASCII (SASLprep is not applied).
     *
     * @throws IllegalArgumentException naming the argument that does not parse
     */
    static Users parse(List<String> specs) {
        SecureRandom random = new SecureRandom();
        Map<String, User> users = new LinkedHashMap<>();
        for (String spec : specs) {
            int first = spec.indexOf(':');
            int last = spec.lastIndexOf(':');
            if (first <= 0 || last == first || last == spec.length() - 1) {
                throw new IllegalArgumentException("user `" + spec
                        + "` is not NAME:PASSWORD:ROLE@DB[+ROLE@DB...] (for example app:secret:readWrite@shop)");
            }
            String name = spec.substring(0, first);
            String password = spec.substring(first + 1, last);
            if (password.isEmpty() || !password.chars().allMatch(c -> c >= 0x20 && c < 0x7f)) {
                throw new IllegalArgumentException("user `" + name
                        + "`: the password must be non-empty printable ASCII (SASLprep is not implemented)");
            }
            if (users.containsKey(name)) {
                throw new IllegalArgumentException("user `" + name + "` is given twice");
            }
            List<Grant> grants = new ArrayList<>();
            List<Roles.Rule> rules = new ArrayList<>();
            for (String entry : spec.substring(last + 1).split("\\+")) {
                int at = entry.lastIndexOf('@');
                if (at <= 0 || at == entry.length() - 1) {
                    throw new IllegalArgumentException("user `" + name + "`: role `" + entry
                            + "` is not ROLE@DB (for example readWrite@shop)");
                }
                Grant grant = new Grant(entry.substring(0, at), entry.substring(at + 1));
                if (!Roles.NAMES.contains(grant.role()) || (Roles.adminOnly(grant.role()) && !grant.db().equals(DB))) {
                    throw new IllegalArgumentException("user `" + name + "`: No role named " + grant
                            + " (this server knows " + String.join(", ", new TreeSet<>(Roles.NAMES))
                            + "; root and the ...AnyDatabase roles exist on admin only)");
                }
                grants.add(grant);
                rules.addAll(Roles.grants(grant.role(), grant.db()));
            }
            users.put(name, new User(name, List.copyOf(grants), Scram.Credentials.derive(password, random),
                    new Roles.Privileges(List.copyOf(rules))));
        }
        return new Users(users);
    }

    /** The user {@code name} defined on {@code db}, or null (every user is defined on admin). */
    User find(String db, String name) {
        return DB.equals(db) ? users.get(name) : null;
    }
}
