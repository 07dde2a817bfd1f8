package mongotx.testserver;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;

import de.bwaldvogel.mongo.backend.DefaultQueryMatcher;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;

/**
 * A collection's validator (https://www.mongodb.com/docs/manual/core/schema-validation/): a query
 * that every inserted or updated document must match, made of {@code $jsonSchema} and other query
 * operators (combined with {@code $and}, {@code $or}, {@code $nor}), with its
 * {@code validationLevel} (strict, moderate, off) and {@code validationAction} (error, warn).
 *
 * <p>A document that fails is explained as MongoDB 5.0+ does in {@code errInfo.details}: the
 * operator that failed, with the clauses of {@code $and} / {@code $or} / {@code $nor} that did not
 * hold and, for {@code $jsonSchema}, the rules and properties that failed.
 */
final class Validator {

    private static final Set<String> LEVELS = Set.of("strict", "moderate", "off");
    private static final Set<String> ACTIONS = Set.of("error", "warn");
    private static final Set<String> FORBIDDEN = Set.of("$where", "$near", "$nearSphere", "$text");

    private final Document query;
    private final Clause root;
    private final String level;
    private final String action;

    private Validator(Document query, String level, String action) {
        this.query = query;
        this.root = Clause.of(query);
        this.level = level;
        this.action = action;
    }

    /**
     * A validator from {@code create} / {@code collMod} options; {@code previous} (may be null)
     * supplies what {@code collMod} leaves out. Null when nothing was asked of validation.
     */
    static Validator of(Document options, Validator previous) {
        boolean any = options.containsKey("validator") || options.containsKey("validationLevel")
                || options.containsKey("validationAction");
        if (!any) {
            return previous;
        }
        Document query = previous != null ? previous.query : new Document();
        String level = previous != null ? previous.level : "strict";
        String action = previous != null ? previous.action : "error";
        if (options.containsKey("validator")) {
            if (!(options.get("validator") instanceof Document given)) {
                throw new MongoServerError(14, "TypeMismatch", "'validator' option must be a document");
            }
            query = given;
        }
        if (options.containsKey("validationLevel")) {
            Object given = options.get("validationLevel");
            if (!(given instanceof String text) || !LEVELS.contains(text)) {
                throw new MongoServerError(2, "BadValue", "Enumeration value '" + given
                        + "' for field 'validationLevel' is not a valid value.");
            }
            level = text;
        }
        if (options.containsKey("validationAction")) {
            Object given = options.get("validationAction");
            if (!(given instanceof String text) || !ACTIONS.contains(text)) {
                throw new MongoServerError(2, "BadValue", "Enumeration value '" + given
                        + "' for field 'validationAction' is not a valid value.");
            }
            action = text;
        }
        return new Validator(query, level, action);
    }

    /** The options {@code listCollections} reports. */
    Document options() {
        return new Document("validator", query).append("validationLevel", level).append("validationAction", action);
    }

    /** Whether writes are checked at all. */
    boolean enabled() {
        return !level.equals("off") && !query.isEmpty();
    }

    /** Whether an update of a document that already failed the validator is let through (moderate). */
    boolean skipsInvalidOriginals() {
        return level.equals("moderate");
    }

    /** Whether a failing document is still written (warn). */
    boolean warnsOnly() {
        return action.equals("warn");
    }

    /** Null if {@code document} passes, otherwise the explanation of why not. */
    Document explain(Document document) {
        return root.holds(document) ? null : root.explain(document);
    }

    /** One node of the validator's query. */
    private abstract static class Clause {

        static Clause of(Document query) {
            List<Clause> parts = new ArrayList<>();
            for (Map.Entry<String, Object> entry : query.entrySet()) {
                parts.add(of(entry.getKey(), entry.getValue()));
            }
            return parts.size() == 1 ? parts.get(0) : new Logical("$and", parts);
        }

        private static Clause of(String key, Object value) {
            if (FORBIDDEN.contains(key)) {
                throw new MongoServerError(2, "BadValue", key + " is not allowed in collection validators");
            }
            switch (key) {
                case "$jsonSchema":
                    return new Schema(JsonSchema.parse(value));
                case "$and":
                case "$or":
                case "$nor":
                    if (!(value instanceof List<?> items) || items.isEmpty()) {
                        throw new MongoServerError(2, "BadValue", key + " must be a nonempty array");
                    }
                    List<Clause> parts = new ArrayList<>();
                    for (Object item : items) {
                        if (!(item instanceof Document clause)) {
                            throw new MongoServerError(2, "BadValue", key + "/$or/$nor entries need to be full objects");
                        }
                        parts.add(of(clause));
                    }
                    return new Logical(key, parts);
                default:
                    return new Leaf(new Document(key, value));
            }
        }

        abstract Document explain(Document document);

        /**
         * Whether {@code document} passes: what {@code explain(document) == null} says, without
         * building the explanation of every clause an {@code $or} rules out (most writes pass, and
         * those explanations were most of the validator's time).
         */
        abstract boolean holds(Document document);
    }

    private static final class Schema extends Clause {
        private final JsonSchema schema;

        Schema(JsonSchema schema) {
            this.schema = schema;
        }

        @Override
        Document explain(Document document) {
            return schema.explain(document);
        }

        @Override
        boolean holds(Document document) {
            return schema.matches(document);
        }
    }

    private static final class Logical extends Clause {
        private final String operator;
        private final List<Clause> parts;

        Logical(String operator, List<Clause> parts) {
            this.operator = operator;
            this.parts = parts;
        }

        @Override
        Document explain(Document document) {
            List<Document> failed = new ArrayList<>();
            List<Document> held = new ArrayList<>();
            for (int i = 0; i < parts.size(); i++) {
                Document details = parts.get(i).explain(document);
                if (details != null) {
                    failed.add(new Document("index", i).append("details", details));
                } else {
                    held.add(new Document("index", i));
                }
            }
            boolean ok = switch (operator) {
                case "$and" -> failed.isEmpty();
                case "$or" -> failed.size() < parts.size();
                default -> held.isEmpty();
            };
            if (ok) {
                return null;
            }
            if (operator.equals("$nor")) {
                return new Document("operatorName", operator).append("clausesSatisfied", held);
            }
            return new Document("operatorName", operator).append("clausesNotSatisfied", failed);
        }

        @Override
        boolean holds(Document document) {
            return switch (operator) {
                case "$and" -> parts.stream().allMatch(part -> part.holds(document));
                case "$or" -> parts.stream().anyMatch(part -> part.holds(document));
                default -> parts.stream().noneMatch(part -> part.holds(document));
            };
        }
    }

    /** Any other query condition, matched by the server's query engine. */
    private static final class Leaf extends Clause {
        private final Document condition;

        Leaf(Document condition) {
            this.condition = condition;
        }

        @Override
        boolean holds(Document document) {
            return new DefaultQueryMatcher().matches(document, condition);
        }

        @Override
        Document explain(Document document) {
            if (holds(document)) {
                return null;
            }
            String field = condition.keySet().iterator().next();
            Object spec = condition.get(field);
            String operator = field.startsWith("$") ? field
                    : spec instanceof Document d && !d.isEmpty() && d.keySet().iterator().next().startsWith("$")
                            ? d.keySet().iterator().next()
                            : "$eq";
            Document details = new Document("operatorName", operator).append("specifiedAs", condition);
            if (operator.equals("$expr")) {
                return details.append("reason", "expression did not match").append("expressionResult", false);
            }
            Object considered = de.bwaldvogel.mongo.backend.Utils.getSubdocumentValue(document, field);
            if (considered instanceof de.bwaldvogel.mongo.backend.Missing) {
                return details.append("reason", operator.equals("$exists") ? "path does not exist"
                        : "field was missing");
            }
            return details.append("reason", operator.equals("$exists") ? "path does exist"
                    : operator.equals("$type") ? "type did not match" : "comparison failed")
                    .append("consideredValue", considered);
        }
    }
}
