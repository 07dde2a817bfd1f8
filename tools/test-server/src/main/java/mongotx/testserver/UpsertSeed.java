package mongotx.testserver;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;

import de.bwaldvogel.mongo.bson.BsonRegularExpression;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;

/**
 * The document an upsert starts from when its filter matches nothing
 * (https://www.mongodb.com/docs/manual/reference/method/db.collection.update/#upsert-behavior): the
 * filter's equality conditions, top-level or on dotted paths, written plainly or with {@code $eq},
 * including those inside {@code $and} (and a one-clause {@code $or}). An update made of operators
 * or a pipeline is then applied to it; a replacement document takes only its {@code _id}.
 */
final class UpsertSeed {

    private UpsertSeed() {
    }

    /** The seed of {@code filter}, {@code _id} first when the filter names one. */
    static Document of(Document filter) {
        Document seed = new Document();
        List<String> paths = new ArrayList<>();
        collect(filter, seed, paths);
        if (seed.containsKey("_id")) {
            Document ordered = new Document("_id", seed.get("_id"));
            for (Map.Entry<String, Object> entry : seed.entrySet()) {
                ordered.putIfAbsent(entry.getKey(), entry.getValue());
            }
            return ordered;
        }
        return seed;
    }

    private static void collect(Document filter, Document seed, List<String> paths) {
        for (Map.Entry<String, Object> entry : filter.entrySet()) {
            String key = entry.getKey();
            Object value = entry.getValue();
            if (key.equals("$and") && value instanceof List<?> clauses) {
                for (Object clause : clauses) {
                    if (clause instanceof Document d) {
                        collect(d, seed, paths);
                    }
                }
            } else if (key.equals("$or") && value instanceof List<?> clauses && clauses.size() == 1
                    && clauses.get(0) instanceof Document only) {
                collect(only, seed, paths);
            } else if (key.startsWith("$")) {
                continue;
            } else if (value instanceof Document condition && !condition.isEmpty()
                    && condition.keySet().iterator().next().startsWith("$")) {
                if (condition.containsKey("$eq")) {
                    put(seed, paths, key, condition.get("$eq"));
                }
            } else if (!(value instanceof BsonRegularExpression)) {
                put(seed, paths, key, value);
            }
        }
    }

    private static void put(Document seed, List<String> paths, String path, Object value) {
        for (String other : paths) {
            if (other.equals(path)) {
                throw new MongoServerError(54, "NotSingleValueField",
                        "cannot infer query fields to set, path '" + path + "' is matched twice");
            }
            if (other.startsWith(path + ".") || path.startsWith(other + ".")) {
                String longer = other.length() > path.length() ? other : path;
                String shorter = other.length() > path.length() ? path : other;
                throw new MongoServerError(54, "NotSingleValueField", "cannot infer query fields to set, both paths '"
                        + longer + "' and '" + shorter + "' are matched");
            }
        }
        paths.add(path);
        String[] parts = path.split("\\.");
        Document target = seed;
        for (int i = 0; i < parts.length - 1; i++) {
            if (!(target.get(parts[i]) instanceof Document inner)) {
                Document created = new Document();
                target.put(parts[i], created);
                target = created;
            } else {
                target = inner;
            }
        }
        target.put(parts[parts.length - 1], value instanceof Document d ? d.cloneDeeply() : value);
    }
}
