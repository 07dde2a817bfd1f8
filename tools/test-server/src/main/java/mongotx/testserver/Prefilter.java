package mongotx.testserver;

import java.util.ArrayList;
import java.util.Collections;
import java.util.HashSet;
import java.util.List;
import java.util.Set;

import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.bson.ObjectId;

/**
 * A quick test that rules documents out of a query filter before mongo-java-server's matcher
 * looks at them: it answers "cannot match" or "may match", never "matches".
 *
 * <p>The stock matcher re-parses the filter for every document (splitting each path, cloning
 * operator documents, building a set per {@code $in}), which costs about half a microsecond per
 * clause and document. MongoDB parses a filter once and evaluates the parsed tree, so a clause on a
 * field a document lacks costs it next to nothing; with the stock matcher, a filter whose second
 * {@code $or} branch names a nested array field made every scan twice as slow as the first branch
 * alone. This tree is built once per filter and decides the common clauses exactly where their
 * paths run through documents only: equality with a string or an ObjectId (plain, {@code $eq},
 * {@code $in}), {@code $exists}, and {@code $and} / {@code $or} of those. A path that meets an
 * array before its last step, and every other operator, answers "may match" and leaves the
 * decision to the stock matcher, so the results are the stock matcher's by construction.
 *
 * <p>A filter holding anything this class does not know (an unknown operator, a malformed
 * argument, {@code $expr}, {@code $where} and the like) gets no prefilter at all, so that every
 * error the stock matcher raises while it evaluates a filter is still raised for the same
 * documents.
 */
final class Prefilter {

    /** Field operators whose arguments the stock matcher never refuses, and that may be left to it. */
    private static final Set<String> LEFT_TO_MATCHER = Set.of("$gt", "$gte", "$lt", "$lte", "$ne");

    private interface Node {
        boolean mayMatch(Document document);
    }

    private static final Node MAYBE = document -> true;

    private final Node root;

    private Prefilter(Node root) {
        this.root = root;
    }

    /** The test for {@code filter}, or null when {@code filter} uses something it does not know. */
    static Prefilter compile(Document filter) {
        try {
            return new Prefilter(conjunction(filter));
        } catch (Unknown e) {
            return null;
        }
    }

    /** False when {@code document} cannot match the filter; true when it may. */
    boolean mayMatch(Document document) {
        return root.mayMatch(document);
    }

    /** Thrown while compiling on the first construct left out. */
    private static final class Unknown extends Exception {
        private static final long serialVersionUID = 1L;

        Unknown() {
            super(null, null, false, false);
        }
    }

    private static Node conjunction(Document filter) throws Unknown {
        List<Node> parts = new ArrayList<>();
        for (var entry : filter.entrySet()) {
            String key = entry.getKey();
            Object value = entry.getValue();
            switch (key) {
                case "$and" -> parts.add(all(branches(value)));
                case "$or" -> parts.add(any(branches(value)));
                case "$nor" -> {
                    // Checked for what it holds; a negation cannot rule anything out here.
                    branches(value);
                    parts.add(MAYBE);
                }
                case "$comment" -> parts.add(MAYBE);
                default -> parts.add(field(path(key), value));
            }
        }
        return all(parts);
    }

    private static List<Node> branches(Object value) throws Unknown {
        if (!(value instanceof List<?> items) || items.isEmpty()) {
            throw new Unknown();
        }
        List<Node> nodes = new ArrayList<>(items.size());
        for (Object item : items) {
            if (!(item instanceof Document branch)) {
                throw new Unknown();
            }
            nodes.add(conjunction(branch));
        }
        return nodes;
    }

    private static String[] path(String key) throws Unknown {
        if (key.isEmpty() || key.startsWith("$")) {
            throw new Unknown();
        }
        String[] steps = key.split("\\.", -1);
        for (String step : steps) {
            if (step.isEmpty() || step.startsWith("$")) {
                throw new Unknown();
            }
        }
        return steps;
    }

    private static Node field(String[] path, Object condition) throws Unknown {
        if (!(condition instanceof Document operators) || operators.isEmpty()
                || !operators.keySet().iterator().next().startsWith("$")) {
            // Equality with a value (a document value compares whole: left to the matcher).
            return equals(path, Collections.singletonList(condition));
        }
        List<Node> parts = new ArrayList<>();
        for (var entry : operators.entrySet()) {
            String operator = entry.getKey();
            Object argument = entry.getValue();
            switch (operator) {
                case "$eq" -> parts.add(equals(path, Collections.singletonList(argument)));
                case "$in" -> {
                    if (!(argument instanceof List<?> values)) {
                        throw new Unknown();
                    }
                    parts.add(equals(path, values));
                }
                case "$exists" -> {
                    if (!(argument instanceof Boolean wanted)) {
                        throw new Unknown();
                    }
                    parts.add(document -> exists(path, document, wanted));
                }
                default -> {
                    if (!LEFT_TO_MATCHER.contains(operator)) {
                        throw new Unknown();
                    }
                    parts.add(MAYBE);
                }
            }
        }
        return all(parts);
    }

    /** Equality with one of {@code values}: decided only when every value is a string or an ObjectId. */
    private static Node equals(String[] path, List<?> values) {
        Set<Object> wanted = new HashSet<>();
        for (Object value : values) {
            if (!(value instanceof String || value instanceof ObjectId)) {
                return MAYBE;
            }
            wanted.add(value);
        }
        return document -> {
            Object found = resolve(path, document);
            if (found == AMBIGUOUS) {
                return true;
            }
            if (found instanceof List<?> elements) {
                // An array matches when one of its elements does (a string or an id never equals a
                // whole array); arrays within it are left to the matcher.
                for (Object element : elements) {
                    if (element instanceof List<?> || wanted.contains(element)) {
                        return true;
                    }
                }
                return false;
            }
            return found != null && wanted.contains(found);
        };
    }

    private static boolean exists(String[] path, Document document, boolean wanted) {
        Object found = resolve(path, document);
        if (found == AMBIGUOUS) {
            return true;
        }
        return (found != ABSENT) == wanted;
    }

    /** What {@link #resolve} returns for a path that runs through an array before its last step. */
    private static final Object AMBIGUOUS = new Object();

    /** What {@link #resolve} returns for a path that leads nowhere. */
    private static final Object ABSENT = new Object();

    /** The value at {@code path}: {@link #ABSENT}, {@link #AMBIGUOUS}, or the value (null for BSON null). */
    private static Object resolve(String[] path, Document document) {
        Object current = document;
        for (String step : path) {
            if (current instanceof Document inner) {
                current = inner.getOrDefault(step, ABSENT);
            } else if (current instanceof List<?>) {
                return AMBIGUOUS;
            } else {
                return ABSENT;
            }
        }
        return current;
    }

    private static Node all(List<Node> parts) {
        List<Node> deciding = parts.stream().filter(p -> p != MAYBE).toList();
        if (deciding.isEmpty()) {
            return MAYBE;
        }
        if (deciding.size() == 1) {
            return deciding.get(0);
        }
        Node[] nodes = deciding.toArray(new Node[0]);
        return document -> {
            for (Node node : nodes) {
                if (!node.mayMatch(document)) {
                    return false;
                }
            }
            return true;
        };
    }

    private static Node any(List<Node> parts) {
        if (parts.contains(MAYBE)) {
            return MAYBE;
        }
        Node[] nodes = parts.toArray(new Node[0]);
        return document -> {
            for (Node node : nodes) {
                if (node.mayMatch(document)) {
                    return true;
                }
            }
            return false;
        };
    }
}
