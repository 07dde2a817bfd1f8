package de.bwaldvogel.mongo.backend;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;

import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;
import mongotx.testserver.Copies;

/**
 * The mongotx test server's bridge to mongo-java-server's update operators, which are package
 * private: it computes the document an operator-style update ({@code $set}, {@code $inc}, ...)
 * makes of a copy of a stored one, without storing anything, so that the server can validate the
 * result (and refuse it) before it replaces the stored document.
 *
 * <p>Where mongo-java-server and MongoDB differ on an operator the server depends on, the
 * difference is handled here before the operators run: {@code $inc} and {@code $mul} of 64-bit
 * integers that overflow fail (mongo-java-server wraps around), and a path named by two operators
 * is refused up front.
 */
public final class OperatorUpdates {

    private OperatorUpdates() {
    }

    /**
     * The result of applying the operators of {@code update} to a deep copy of {@code document}.
     *
     * @param statement the statement or command that carries {@code arrayFilters}, if any
     * @param matchPos the array position the query matched (for the positional {@code $} operator)
     * @param upsert whether the document is being inserted ({@code $setOnInsert} applies)
     * @param allowEmptyOperand whether an operator may have an empty operand (MongoDB 5.0+)
     */
    public static Document apply(Document document, Document update, Document statement, Integer matchPos,
            boolean upsert, boolean allowEmptyOperand) {
        List<String> paths = new ArrayList<>();
        for (Map.Entry<String, Object> entry : update.entrySet()) {
            String operator = entry.getKey();
            if (!operator.startsWith("$")) {
                throw new MongoServerError(9, "FailedToParse",
                        "Unknown modifier: " + operator + ". Expected a valid update modifier or pipeline-style update specified as an array");
            }
            try {
                UpdateOperator.fromValue(operator);
            } catch (RuntimeException e) {
                throw new MongoServerError(9, "FailedToParse",
                        "Unknown modifier: " + operator + ". Expected a valid update modifier or pipeline-style update specified as an array");
            }
            if (!(entry.getValue() instanceof Document change)) {
                throw new MongoServerError(9, "FailedToParse", "Modifiers operate on fields but we found type "
                        + Utils.describeType(entry.getValue()) + " instead. For example: {$mod: {<field>: ...}} not {"
                        + operator + ": " + entry.getValue() + "}");
            }
            if (change.isEmpty() && !allowEmptyOperand) {
                throw new MongoServerError(9, "FailedToParse", "'" + operator
                        + "' is empty. You must specify a field like so: {" + operator + ": {<field>: ...}}");
            }
            for (String path : change.keySet()) {
                for (String other : paths) {
                    String shorter = Utils.getShorterPathIfPrefix(path, other);
                    if (shorter != null) {
                        throw new MongoServerError(40, "ConflictingUpdateOperators",
                                "Updating the path '" + path + "' would create a conflict at '" + shorter + "'");
                    }
                }
                paths.add(path);
                if (operator.equals("$rename") && change.get(path) instanceof String target) {
                    paths.add(target);
                }
            }
        }
        checkOverflow(document, update, "$inc");
        checkOverflow(document, update, "$mul");

        // The same copy as cloneDeeply (nothing shared with the stored document), built in one pass
        // instead of three maps per level: it was half the cost of applying a quota consume.
        Document result = Copies.deep(document);
        ArrayFilters arrayFilters = ArrayFilters.parse(statement, update);
        for (String operator : update.keySet()) {
            Document change = (Document) update.get(operator);
            new FieldUpdates(result, UpdateOperator.fromValue(operator), Constants.ID_FIELD, upsert, matchPos,
                    arrayFilters).apply(change, operator);
        }
        Utils.validateFieldNames(result);
        return result;
    }

    /** MongoDB refuses a 64-bit {@code $inc} or {@code $mul} whose result does not fit. */
    private static void checkOverflow(Document document, Document update, String operator) {
        if (!(update.get(operator) instanceof Document change)) {
            return;
        }
        for (Map.Entry<String, Object> entry : change.entrySet()) {
            Object current = Utils.getSubdocumentValue(document, entry.getKey());
            if (!(current instanceof Integer || current instanceof Long)
                    || !(entry.getValue() instanceof Integer || entry.getValue() instanceof Long)) {
                continue;
            }
            long a = ((Number) current).longValue();
            long b = ((Number) entry.getValue()).longValue();
            try {
                if (operator.equals("$inc")) {
                    Math.addExact(a, b);
                } else {
                    Math.multiplyExact(a, b);
                }
            } catch (ArithmeticException overflow) {
                String type = current instanceof Long ? "NumberLong" : "NumberInt";
                throw new MongoServerError(2, "BadValue", "Failed to apply " + operator + " operations to current value (("
                        + type + ")" + current + ") for document {_id: " + document.get(Constants.ID_FIELD) + "}");
            }
        }
    }
}
