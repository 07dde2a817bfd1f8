package de.bwaldvogel.mongo.backend.aggregation.stage;

import java.util.stream.Stream;

import de.bwaldvogel.mongo.backend.Missing;
import de.bwaldvogel.mongo.backend.Utils;
import de.bwaldvogel.mongo.backend.aggregation.Evaluation;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;

/**
 * The mongotx test server's replacement for mongo-java-server's {@code $replaceRoot} stage (and so
 * {@code $replaceWith}); the shaded jar leaves the original out (see pom.xml).
 *
 * <p>The original evaluated {@code newRoot} and then evaluated every field of the document it got
 * once more, as if that document were an expression: a stored string starting with {@code $}
 * became a field path or a variable ({@code "$x"} vanished, {@code "$$NOW"} became a date, a
 * nested one broke the connection), so {@code {newRoot: "$$ROOT"}} did not even return its input.
 * MongoDB evaluates {@code newRoot} once and takes the document it yields as it is
 * (https://www.mongodb.com/docs/manual/reference/operator/aggregation/replaceRoot/), except that a
 * field of an expression object whose expression yields nothing (a missing field) is left out
 * (https://www.mongodb.com/docs/manual/reference/operator/aggregation/replaceWith/); the stock
 * evaluator kept it as a missing value, which broke the connection that read it back.
 */
public class ReplaceRootStage implements AggregationStage {

    private final Object newRoot;

    public ReplaceRootStage(Document stage) {
        newRoot = stage.getOrMissing("newRoot");
        if (Missing.isNullOrMissing(newRoot)) {
            throw new MongoServerError(40231, "no newRoot specified for the $replaceRoot stage");
        }
    }

    /**
     * {@code root} without the fields that {@code expression} (an expression object) made missing,
     * at every level the expression object spells out.
     */
    private static Document withoutMissing(Document root, Document expression) {
        if (expression.keySet().stream().anyMatch(key -> key.startsWith("$"))) {
            return root;
        }
        Document kept = new Document();
        for (java.util.Map.Entry<String, Object> entry : root.entrySet()) {
            Object value = entry.getValue();
            if (value instanceof Missing) {
                continue;
            }
            if (value instanceof Document inner && expression.get(entry.getKey()) instanceof Document spelled) {
                value = withoutMissing(inner, spelled);
            }
            kept.put(entry.getKey(), value);
        }
        return kept;
    }

    @Override
    public String name() {
        return "$replaceRoot";
    }

    @Override
    public Stream<Document> apply(Stream<Document> stream) {
        return stream.map(this::replaceRoot);
    }

    private Document replaceRoot(Document document) {
        Object result = Evaluation.evaluate(newRoot, document);
        if (result instanceof Document root) {
            return newRoot instanceof Document expression ? withoutMissing(root, expression) : root;
        }
        throw new MongoServerError(40228, "'newRoot' expression must evaluate to an object, but resulting value was: "
                + result + ". Type of resulting value: '" + Utils.describeType(result) + "'");
    }
}
