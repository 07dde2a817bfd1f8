package de.bwaldvogel.mongo.backend.aggregation;

import de.bwaldvogel.mongo.bson.Document;

/**
 * The mongotx test server's access to mongo-java-server's expression evaluator, whose entry point
 * is package private: one aggregation expression evaluated against one document, with no further
 * evaluation of what it returns (a document that an expression returns is a value, not an
 * expression, even where one of its strings starts with {@code $}).
 */
public final class Evaluation {

    private Evaluation() {
    }

    /** The value of {@code expression} for {@code document}; a missing field is {@code Missing}. */
    public static Object evaluate(Object expression, Document document) {
        return Expression.evaluate(expression, document);
    }
}
