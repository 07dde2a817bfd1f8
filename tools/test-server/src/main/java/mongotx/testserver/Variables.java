package mongotx.testserver;

import java.time.Instant;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.function.BiFunction;
import java.util.function.UnaryOperator;

import de.bwaldvogel.mongo.backend.Missing;
import de.bwaldvogel.mongo.backend.aggregation.Evaluation;
import de.bwaldvogel.mongo.bson.BsonTimestamp;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;

/**
 * The variables of one statement: {@code $$NOW}, read once from the statement's collection clock,
 * and the command's {@code let} constants (MongoDB 5.0+).
 *
 * <p>MongoDB fixes {@code $$NOW} for a whole statement: its filter, every stage of its update
 * pipeline and every document a multi-document statement touches see one instant
 * (https://www.mongodb.com/docs/manual/reference/aggregation-variables/#mongodb-variable-variable.NOW).
 * mongo-java-server reads the clock wherever an expression asks for it. So before a statement runs,
 * every {@code $$NOW} (and {@code $$<let variable>}) in an expression context of its filter, update
 * and pipelines is replaced by its value as a literal, and {@code $currentDate} becomes a
 * {@code $set} of the same instant.
 */
final class Variables {

    /** Numbers the variables of the element wrappers {@link #evaluatedArray} builds. */
    private static final java.util.concurrent.atomic.AtomicLong ELEMENT_NAMES = new java.util.concurrent.atomic.AtomicLong();

    /** A field path no document has: evaluates to a missing value. */
    private static final String MISSING = "$__mongotx_missing__";
    private static final Set<String> STAGES_WITHOUT_EXPRESSIONS = Set.of("$sort", "$limit", "$skip", "$count",
            "$unset", "$out", "$sample", "$indexStats");

    private final Instant now;
    private final Map<String, Object> values;

    private Variables(Instant now, Map<String, Object> values) {
        this.now = now;
        this.values = values;
    }

    /**
     * The variables of a statement run at {@code now}; {@code let} (may be null) holds expressions
     * evaluated once, which may use {@code $$NOW} but no field of any document.
     */
    static Variables of(Instant now, Document let) {
        Map<String, Object> values = new HashMap<>();
        values.put("NOW", now);
        Variables variables = new Variables(now, values);
        if (let != null) {
            Map<String, Object> constants = new HashMap<>();
            for (Map.Entry<String, Object> entry : let.entrySet()) {
                String name = entry.getKey();
                if (name.isEmpty() || !Character.isLowerCase(name.charAt(0))) {
                    throw new MongoServerError(16867, "FailedToParse",
                            "'" + name + "' starts with an invalid character for a user variable name");
                }
                Object expression = variables.inExpression(entry.getValue(), Set.of());
                Object value = Evaluation.evaluate(expression, new Document());
                constants.put(name, value);
            }
            values.putAll(constants);
        }
        return variables;
    }

    /** The instant {@code $$NOW} stands for. */
    Instant now() {
        return now;
    }

    /** A query filter: variables are replaced inside {@code $expr} only (elsewhere they are plain strings). */
    @SuppressWarnings("unchecked")
    <T> T inFilter(T filter) {
        if (filter instanceof Document document) {
            Document result = new Document();
            for (Map.Entry<String, Object> entry : document.entrySet()) {
                Object value = entry.getValue();
                result.put(entry.getKey(),
                        entry.getKey().equals("$expr") ? inExpression(value, Set.of()) : inFilter(value));
            }
            return (T) result;
        }
        if (filter instanceof List<?> list) {
            List<Object> result = new ArrayList<>(list.size());
            for (Object item : list) {
                result.add(inFilter(item));
            }
            return (T) result;
        }
        return filter;
    }

    /** An aggregation pipeline (of an update or of {@code aggregate}), with MongoDB's stage aliases. */
    List<Object> inPipeline(List<?> stages) {
        List<Object> result = new ArrayList<>(stages.size());
        for (Object item : stages) {
            if (!(item instanceof Document stage) || stage.size() != 1) {
                result.add(item);
                continue;
            }
            String name = stage.keySet().iterator().next();
            Object spec = stage.get(name);
            switch (name) {
                case "$set" -> result.add(new Document("$addFields", inExpression(spec, Set.of())));
                case "$replaceWith" -> result.add(
                        new Document("$replaceRoot", new Document("newRoot", inExpression(spec, Set.of()))));
                case "$match" -> result.add(new Document(name, inFilter(spec)));
                case "$lookup" -> result.add(new Document(name, inLookup(spec)));
                case "$facet" -> result.add(new Document(name, inFacet(spec)));
                default -> result.add(STAGES_WITHOUT_EXPRESSIONS.contains(name) ? stage
                        : new Document(name, inExpression(spec, Set.of())));
            }
        }
        return result;
    }

    private Object inLookup(Object spec) {
        if (!(spec instanceof Document lookup)) {
            return spec;
        }
        Document result = new Document();
        for (Map.Entry<String, Object> entry : lookup.entrySet()) {
            Object value = entry.getValue();
            if (entry.getKey().equals("pipeline") && value instanceof List<?> stages) {
                value = inPipeline(stages);
            } else if (entry.getKey().equals("let")) {
                value = inExpression(value, Set.of());
            }
            result.put(entry.getKey(), value);
        }
        return result;
    }

    private Object inFacet(Object spec) {
        if (!(spec instanceof Document facets)) {
            return spec;
        }
        Document result = new Document();
        for (Map.Entry<String, Object> entry : facets.entrySet()) {
            result.put(entry.getKey(),
                    entry.getValue() instanceof List<?> stages ? inPipeline(stages) : entry.getValue());
        }
        return result;
    }

    /**
     * An operator-style update: {@code $currentDate} becomes part of {@code $set}, stamped with this
     * statement's instant (a date, or a timestamp for {@code {$type: "timestamp"}}).
     */
    Document inOperatorUpdate(Document update) {
        if (!(update.get("$currentDate") instanceof Document currentDate)) {
            return update;
        }
        Document stamps = new Document();
        for (Map.Entry<String, Object> entry : currentDate.entrySet()) {
            Object spec = entry.getValue();
            Object stamp;
            if (spec instanceof Boolean) {
                stamp = now;
            } else if (spec instanceof Document typed && typed.size() == 1 && typed.containsKey("$type")
                    && ("date".equals(typed.get("$type")) || "timestamp".equals(typed.get("$type")))) {
                stamp = "date".equals(typed.get("$type")) ? now
                        : new BsonTimestamp(now, 1);
            } else {
                throw new MongoServerError(2, "BadValue", "The '$type' string field is required to be 'date' or"
                        + " 'timestamp': {$currentDate: {field : {$type: 'date'}}}");
            }
            stamps.put(entry.getKey(), stamp);
        }
        Document result = new Document();
        for (Map.Entry<String, Object> entry : update.entrySet()) {
            if (entry.getKey().equals("$currentDate")) {
                continue;
            }
            result.put(entry.getKey(), entry.getValue());
        }
        // A separate operator name keeps a path named both here and in $set a conflict, as in MongoDB.
        Document set = result.get("$set") instanceof Document existing ? existing.clone() : new Document();
        for (Map.Entry<String, Object> entry : stamps.entrySet()) {
            if (set.containsKey(entry.getKey())) {
                throw new MongoServerError(40, "ConflictingUpdateOperators", "Updating the path '" + entry.getKey()
                        + "' would create a conflict at '" + entry.getKey() + "'");
            }
            set.put(entry.getKey(), entry.getValue());
        }
        result.put("$set", set);
        return result;
    }

    /** An expression: every {@code $$name} of a variable not shadowed by an enclosing operator. */
    private Object inExpression(Object expression, Set<String> shadowed) {
        return inExpression(expression, shadowed, true);
    }

    /**
     * {@link #inExpression(Object, Set)}, where a list is an array literal when {@code literal}
     * (a field's value, an argument, an element) and an operator's arguments when not. MongoDB
     * evaluates every element of an array literal
     * (https://www.mongodb.com/docs/manual/meta/aggregation-quick-reference/#expressions: "array
     * expressions ... evaluate each element"); mongo-java-server hands an array literal back as it
     * is, so {@code [{"s": "$x"}]} stayed a document holding the string "$x". An array literal
     * that holds an expression becomes one the stock evaluator does evaluate: a
     * {@code $concatArrays} of one-element {@code $map}s, one per element.
     */
    private Object inExpression(Object expression, Set<String> shadowed, boolean literal) {
        if (expression instanceof String text) {
            return text.startsWith("$$") ? replace(text, shadowed) : text;
        }
        if (expression instanceof List<?> list) {
            List<?> elements = rewrittenList(list, item -> inExpression(item, shadowed, true));
            return literal ? evaluatedArray(elements) : elements;
        }
        if (!(expression instanceof Document document)) {
            return expression;
        }
        if (document.size() == 1) {
            String operator = document.keySet().iterator().next();
            Object argument = document.get(operator);
            switch (operator) {
                case "$literal":
                    return document;
                case "$let":
                    if (argument instanceof Document let && let.get("vars") instanceof Document vars) {
                        Set<String> inner = new HashSet<>(shadowed);
                        inner.addAll(vars.keySet());
                        Document rewritten = rewritten(let, (key, value) -> key.equals("in")
                                ? inExpression(value, inner)
                                : inExpression(value, shadowed));
                        return rewritten == let ? document : new Document(operator, rewritten);
                    }
                    break;
                case "$switch":
                    // Its branches are a list of {case, then}, not an array literal.
                    if (argument instanceof Document spec) {
                        Document rewritten = rewritten(spec, (key, value) ->
                                key.equals("branches") && value instanceof List<?> branches
                                        ? rewrittenList(branches, branch -> inExpression(branch, shadowed, false))
                                        : inExpression(value, shadowed));
                        return rewritten == spec ? document : new Document(operator, rewritten);
                    }
                    break;
                case "$map":
                case "$filter":
                case "$reduce":
                    if (argument instanceof Document spec) {
                        Set<String> inner = new HashSet<>(shadowed);
                        if (operator.equals("$reduce")) {
                            inner.add("this");
                            inner.add("value");
                        } else {
                            inner.add(spec.get("as") instanceof String as ? as : "this");
                        }
                        Document rewritten = rewritten(spec, (key, value) -> inExpression(value,
                                key.equals("in") || key.equals("cond") ? inner : shadowed));
                        return rewritten == spec ? document : new Document(operator, rewritten);
                    }
                    break;
                default:
                    break;
            }
        }
        // An operator's list is its arguments; any other field's list is an array literal.
        return rewritten(document, (key, value) -> inExpression(value, shadowed, !key.startsWith("$")));
    }

    /**
     * {@code document} with every field's value passed through {@code rewrite}: {@code document}
     * itself when no value changed. Most of a pipeline names no variable, and what the rewrite
     * leaves alone is handed back rather than copied (a rate limiter's grant copied some 300
     * documents per write).
     */
    private static Document rewritten(Document document, BiFunction<String, Object, Object> rewrite) {
        Document result = null;
        for (Map.Entry<String, Object> entry : document.entrySet()) {
            Object value = entry.getValue();
            Object changed = rewrite.apply(entry.getKey(), value);
            if (result == null && changed != value) {
                result = new Document();
                for (Map.Entry<String, Object> before : document.entrySet()) {
                    if (before.getKey().equals(entry.getKey())) {
                        break;
                    }
                    result.put(before.getKey(), before.getValue());
                }
            }
            if (result != null) {
                result.put(entry.getKey(), changed);
            }
        }
        return result != null ? result : document;
    }

    /** {@code list} with every item passed through {@code rewrite}: {@code list} itself when no item changed. */
    private static List<?> rewrittenList(List<?> list, UnaryOperator<Object> rewrite) {
        List<Object> result = null;
        for (int i = 0; i < list.size(); i++) {
            Object item = list.get(i);
            Object changed = rewrite.apply(item);
            if (result == null && changed != item) {
                result = new ArrayList<>(list.subList(0, i));
            }
            if (result != null) {
                result.add(changed);
            }
        }
        return result != null ? result : list;
    }

    /** The array literal {@code elements}, made evaluable by the stock evaluator if it holds an expression. */
    private static Object evaluatedArray(List<?> elements) {
        if (elements.stream().noneMatch(Variables::holdsExpression)) {
            return elements;
        }
        List<Object> parts = new ArrayList<>(elements.size());
        for (Object element : elements) {
            // A name of its own each time: an element may hold another such array, and the stock
            // evaluator refuses a variable that an enclosing $map already binds.
            String name = "mongotxElement" + ELEMENT_NAMES.incrementAndGet();
            parts.add(new Document("$map", new Document("input", new Document("$literal", List.of(0)))
                    .append("as", name).append("in", element)));
        }
        return new Document("$concatArrays", parts);
    }

    /** Whether {@code value} has anything an evaluation would change (a {@code $} string, a document, a list). */
    private static boolean holdsExpression(Object value) {
        return value instanceof Document || value instanceof List<?>
                || (value instanceof String text && text.startsWith("$"));
    }

    private Object replace(String reference, Set<String> shadowed) {
        String body = reference.substring(2);
        int dot = body.indexOf('.');
        String name = dot < 0 ? body : body.substring(0, dot);
        if (shadowed.contains(name) || !values.containsKey(name)) {
            return reference;
        }
        Object value = values.get(name);
        if (dot >= 0) {
            for (String part : body.substring(dot + 1).split("\\.")) {
                value = value instanceof Document d && d.containsKey(part) ? d.get(part) : Missing.getInstance();
            }
        }
        if (value instanceof Missing) {
            return MISSING;
        }
        return new Document("$literal", value);
    }
}
