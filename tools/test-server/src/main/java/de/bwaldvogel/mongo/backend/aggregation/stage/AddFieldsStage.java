package de.bwaldvogel.mongo.backend.aggregation.stage;

import java.util.Map;
import java.util.stream.Stream;

import de.bwaldvogel.mongo.backend.Missing;
import de.bwaldvogel.mongo.backend.aggregation.Evaluation;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;
import mongotx.testserver.Copies;

/**
 * The mongotx test server's replacement for mongo-java-server's {@code $addFields} stage (and so
 * {@code $set}, which the server maps to it); the shaded jar leaves the original out (see
 * pom.xml). It follows MongoDB
 * (https://www.mongodb.com/docs/manual/reference/operator/aggregation/addFields/) where the
 * original did not:
 *
 * <ul>
 * <li>every expression of the stage sees the stage's input document, not the fields the same stage
 * added before it;
 * <li>a field whose expression evaluates to a document is replaced by that document (the original
 * merged it into the field's old value); only a nested specification written in the stage itself
 * ({@code {a: {b: <expr>}}} or {@code "a.b"}) adds to an embedded document;
 * <li>a field whose expression evaluates to a missing value is removed.
 * </ul>
 */
public class AddFieldsStage implements AggregationStage {

    private final Document addFields;

    public AddFieldsStage(Document addFields) {
        if (addFields.isEmpty()) {
            throw new MongoServerError(40177, "Invalid $addFields :: caused by :: specification must have at least one field");
        }
        this.addFields = addFields;
    }

    @Override
    public String name() {
        return "$addFields";
    }

    @Override
    public Stream<Document> apply(Stream<Document> stream) {
        return stream.map(this::projectDocument);
    }

    Document projectDocument(Document document) {
        Document result = Copies.shallow(document);
        add(result, document, addFields);
        return result;
    }

    private static void add(Document target, Document root, Document spec) {
        for (Map.Entry<String, Object> entry : spec.entrySet()) {
            String key = entry.getKey();
            Object value = entry.getValue();
            int dot = key.indexOf('.');
            if (dot > 0) {
                nested(target, root, key.substring(0, dot), new Document(key.substring(dot + 1), value));
            } else if (value instanceof Document nested && !nested.isEmpty() && !isExpression(nested)) {
                nested(target, root, key, nested);
            } else {
                Object computed = Evaluation.evaluate(value, root);
                if (computed instanceof Missing) {
                    target.remove(key);
                } else {
                    target.put(key, computed);
                }
            }
        }
    }

    private static void nested(Document target, Document root, String key, Document spec) {
        Document inner = target.get(key) instanceof Document existing ? Copies.shallow(existing) : new Document();
        add(inner, root, spec);
        target.put(key, inner);
    }

    private static boolean isExpression(Document value) {
        return value.keySet().iterator().next().startsWith("$");
    }
}
