package mongotx.testserver;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

import de.bwaldvogel.mongo.backend.Missing;
import de.bwaldvogel.mongo.backend.aggregation.Evaluation;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;

/**
 * A find-style projection, as {@code findAndModify}'s {@code fields} applies it
 * (https://www.mongodb.com/docs/manual/reference/method/db.collection.find/#projection): inclusion
 * or exclusion of top-level and dotted paths (through embedded documents and arrays of them),
 * {@code _id} included unless excluded, computed fields in an inclusion, and the document's own
 * field order kept.
 */
final class Projection {

    /** A path tree: a leaf includes (or excludes) everything under it; an inner node goes deeper. */
    private static final class Node {
        final Map<String, Node> children = new LinkedHashMap<>();
        Object computed;
        boolean leaf;
    }

    private final Node root = new Node();
    private final boolean inclusion;
    private final boolean withId;

    private Projection(Document fields) {
        Boolean mode = null;
        boolean id = true;
        for (Map.Entry<String, Object> entry : fields.entrySet()) {
            String path = entry.getKey();
            Object value = entry.getValue();
            boolean flag = value instanceof Boolean || value instanceof Number;
            if (path.equals("_id") && flag) {
                id = truthy(value);
                continue;
            }
            boolean includes = !flag || truthy(value);
            if (mode != null && mode != includes) {
                throw new MongoServerError(31254, "Location31254", includes
                        ? "Cannot do inclusion on field " + path + " in exclusion projection"
                        : "Cannot do exclusion on field " + path + " in inclusion projection");
            }
            mode = includes;
            Node node = root;
            for (String part : path.split("\\.")) {
                node = node.children.computeIfAbsent(part, k -> new Node());
            }
            node.leaf = true;
            if (!flag) {
                node.computed = value;
            }
        }
        this.inclusion = mode == null || mode;
        this.withId = id;
    }

    /** {@code document} as {@code fields} shows it (null stays null). */
    static Document apply(Document document, Document fields) {
        if (document == null || fields == null || fields.isEmpty()) {
            return document;
        }
        return new Projection(fields).project(document);
    }

    private Document project(Document document) {
        Document result;
        if (inclusion) {
            result = include(document, root, document);
            if (withId && document.containsKey("_id")) {
                Document withIdFirst = new Document("_id", document.get("_id"));
                result.forEach(withIdFirst::putIfAbsent);
                result = withIdFirst;
            } else if (!withId) {
                result.remove("_id");
            }
        } else {
            result = exclude(document, root);
            if (!withId) {
                result.remove("_id");
            }
        }
        return result;
    }

    private static Document include(Document source, Node node, Document root) {
        Document result = new Document();
        for (Map.Entry<String, Object> entry : source.entrySet()) {
            Node child = node.children.get(entry.getKey());
            if (child == null) {
                continue;
            }
            if (child.leaf && child.computed == null) {
                result.put(entry.getKey(), entry.getValue());
            } else if (!child.leaf) {
                Object value = includeValue(entry.getValue(), child, root);
                if (value != null) {
                    result.put(entry.getKey(), value);
                }
            }
        }
        // Computed fields come after the stored ones, in the projection's order.
        for (Map.Entry<String, Node> entry : node.children.entrySet()) {
            if (entry.getValue().computed != null) {
                Object value = Evaluation.evaluate(entry.getValue().computed, root);
                if (!(value instanceof Missing)) {
                    result.put(entry.getKey(), value);
                }
            }
        }
        return result;
    }

    private static Object includeValue(Object value, Node node, Document root) {
        if (value instanceof Document inner) {
            return include(inner, node, root);
        }
        if (value instanceof List<?> items) {
            List<Object> kept = new ArrayList<>();
            for (Object item : items) {
                Object projected = includeValue(item, node, root);
                if (projected != null) {
                    kept.add(projected);
                }
            }
            return kept;
        }
        return null;
    }

    private static Document exclude(Document source, Node node) {
        Document result = new Document();
        for (Map.Entry<String, Object> entry : source.entrySet()) {
            Node child = node.children.get(entry.getKey());
            if (child == null) {
                result.put(entry.getKey(), entry.getValue());
            } else if (!child.leaf) {
                result.put(entry.getKey(), excludeValue(entry.getValue(), child));
            }
        }
        return result;
    }

    private static Object excludeValue(Object value, Node node) {
        if (value instanceof Document inner) {
            return exclude(inner, node);
        }
        if (value instanceof List<?> items) {
            List<Object> kept = new ArrayList<>();
            for (Object item : items) {
                kept.add(excludeValue(item, node));
            }
            return kept;
        }
        return value;
    }

    private static boolean truthy(Object value) {
        return value instanceof Boolean b ? b : value instanceof Number n && n.doubleValue() != 0.0;
    }
}
