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
 * is refused up front. After them, a {@code $set} (or an inserting {@code $setOnInsert}) whose value
 * equals the stored one as MongoDB compares values but differs in type or bytes (int 5 and long 5,
 * decimal 1.0 and 1.00, 0.0 and -0.0, or such a value inside a document or array) stores the new
 * value as given: mongo-java-server took the two for the same and kept the old one, where MongoDB
 * replaces it (https://www.mongodb.com/docs/manual/reference/operator/update/set/: "$set replaces
 * the value of a field with the specified value").
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
        keepRepresentation(result, update.get("$set"));
        if (upsert) {
            keepRepresentation(result, update.get("$setOnInsert"));
        }
        Utils.validateFieldNames(result);
        return result;
    }

    /** Stores each value of {@code change} that the operators kept in an equal but other form. */
    private static void keepRepresentation(Document result, Object change) {
        if (!(change instanceof Document values)) {
            return;
        }
        for (Map.Entry<String, Object> entry : values.entrySet()) {
            String path = entry.getKey();
            if (path.contains("$") || path.equals(Constants.ID_FIELD)) {
                continue;
            }
            Object now = Utils.getSubdocumentValue(result, path);
            if (!(now instanceof Missing) && !identical(now, entry.getValue())) {
                Utils.changeSubdocumentValue(result, path, Copies.deepValue(entry.getValue()));
            }
        }
    }

    /**
     * Whether two values are the same BSON value: same type and same bytes (field order and
     * names included), where {@link Utils#nullAwareEquals} compares as MongoDB's queries do.
     */
    static boolean identical(Object a, Object b) {
        if (a instanceof Document da && b instanceof Document db) {
            if (!new ArrayList<>(da.keySet()).equals(new ArrayList<>(db.keySet()))) {
                return false;
            }
            for (String key : da.keySet()) {
                if (!identical(da.get(key), db.get(key))) {
                    return false;
                }
            }
            return true;
        }
        if (a instanceof List<?> la && b instanceof List<?> lb) {
            if (la.size() != lb.size()) {
                return false;
            }
            for (int i = 0; i < la.size(); i++) {
                if (!identical(la.get(i), lb.get(i))) {
                    return false;
                }
            }
            return true;
        }
        if (a == null || b == null) {
            return a == b;
        }
        // Double.equals tells 0.0 from -0.0 (and holds NaN equal to itself); Decimal128's equals
        // compares its two 64-bit halves, so 1.0 and 1.00 differ.
        return a.getClass().equals(b.getClass()) && a.equals(b);
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
