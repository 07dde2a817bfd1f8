package mongotx.testserver;

import java.math.BigDecimal;
import java.math.MathContext;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Collection;
import java.util.HashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.UUID;
import java.util.regex.Pattern;
import java.util.regex.PatternSyntaxException;

import de.bwaldvogel.mongo.backend.ValueComparator;
import de.bwaldvogel.mongo.bson.BinData;
import de.bwaldvogel.mongo.bson.BsonJavaScript;
import de.bwaldvogel.mongo.bson.BsonRegularExpression;
import de.bwaldvogel.mongo.bson.BsonTimestamp;
import de.bwaldvogel.mongo.bson.Decimal128;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.bson.LegacyUUID;
import de.bwaldvogel.mongo.bson.MaxKey;
import de.bwaldvogel.mongo.bson.MinKey;
import de.bwaldvogel.mongo.bson.ObjectId;
import de.bwaldvogel.mongo.exception.MongoServerError;

/**
 * MongoDB's {@code $jsonSchema} (https://www.mongodb.com/docs/manual/reference/operator/query/jsonSchema/):
 * JSON Schema draft 4 with {@code bsonType}, without {@code $ref}, {@code $schema}, {@code default},
 * {@code definitions}, {@code format}, {@code id} and the {@code integer} type. Keywords that concern
 * one kind of value (numbers, strings, objects, arrays) pass values of other kinds.
 *
 * <p>A document that fails is explained the way MongoDB 5.0+ explains a validation failure in
 * {@code errInfo.details}: {@code {operatorName: "$jsonSchema", schemaRulesNotSatisfied: [...]}},
 * each rule naming its keyword ({@code operatorName}), what the schema specified and, for
 * {@code properties}, the property ({@code propertiesNotSatisfied[].propertyName}) with its own
 * failed rules.
 */
final class JsonSchema {

    /** Keywords {@link Node#holds} can decide; a schema with any other goes through {@link Node#check}. */
    private static final Set<String> QUICK = Set.of("title", "description", "bsonType", "type", "properties",
            "required", "additionalProperties", "items", "enum", "minimum", "maximum", "exclusiveMinimum",
            "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems");
    /** Keywords {@link Node#holds} decides itself rather than by {@link Node#rule}. */
    private static final Set<String> WHOLE = Set.of("bsonType", "type", "properties", "required",
            "additionalProperties", "items");
    /** Keywords that only annotate, or that another keyword's rule reads ({@code minimum} reads {@code exclusiveMinimum}). */
    private static final Set<String> ANNOTATIONS = Set.of("title", "description", "exclusiveMinimum", "exclusiveMaximum");
    private static final Set<String> UNSUPPORTED = Set.of("$ref", "$schema", "default", "definitions", "format", "id");
    private static final MathContext FIFTEEN_DIGITS = new MathContext(15);

    private final Node root;

    private JsonSchema(Node root) {
        this.root = root;
    }

    /**
     * Parses a schema as {@code create} and {@code collMod} do.
     *
     * @throws MongoServerError a FailedToParse (9) or TypeMismatch (14) naming the keyword
     */
    static JsonSchema parse(Object spec) {
        if (!(spec instanceof Document document)) {
            throw new MongoServerError(14, "TypeMismatch", "$jsonSchema must be an object");
        }
        return new JsonSchema(new Node(document, ""));
    }

    /** Whether {@code document} satisfies the schema. */
    boolean matches(Document document) {
        return root.holds(document);
    }

    /** Null if {@code document} satisfies the schema, otherwise the failure as MongoDB details it. */
    Document explain(Document document) {
        if (root.holds(document)) {
            return null;
        }
        List<Document> failures = root.check(document);
        if (failures.isEmpty()) {
            return null;
        }
        Document details = new Document("operatorName", "$jsonSchema");
        if (root.title != null) {
            details.put("title", root.title);
        }
        return details.append("schemaRulesNotSatisfied", failures);
    }

    /** One (sub)schema. */
    private static final class Node {

        private final Document spec;
        /** The keywords of {@code spec} that test a value, in the schema's order. */
        private final List<Map.Entry<String, Object>> rules = new ArrayList<>();
        /** For {@link #holds}: each declared property's schema and whether it is required. */
        private final Map<String, Field> fields = new HashMap<>();
        /** For {@link #holds}: how many required properties are declared ones. */
        private int requiredDeclared;
        /** For {@link #holds}: required properties that {@code properties} does not declare. */
        private final List<String> requiredElsewhere = new ArrayList<>();
        /** For {@link #holds}: the rules its single pass leaves to {@link #rule}. */
        private final List<Map.Entry<String, Object>> others = new ArrayList<>();
        /** Whether {@link #holds} knows every keyword of this schema. */
        private final boolean quick;
        private final String title;
        private final String description;
        private final Set<String> types;
        private final String typeKeyword;
        private final Map<String, Node> properties = new java.util.LinkedHashMap<>();
        private final Map<Pattern, Node> patternProperties = new java.util.LinkedHashMap<>();
        private final Map<String, Object> dependencies = new java.util.LinkedHashMap<>();
        private final List<Node> allOf = new ArrayList<>();
        private final List<Node> anyOf = new ArrayList<>();
        private final List<Node> oneOf = new ArrayList<>();
        private Node not;
        private Node additionalPropertiesSchema;
        private Boolean additionalPropertiesAllowed;
        private Node itemsSchema;
        private List<Node> itemsTuple;
        private Node additionalItemsSchema;
        private Boolean additionalItemsAllowed;
        private Pattern pattern;

        Node(Document spec, String at) {
            this.spec = spec;
            for (Map.Entry<String, Object> entry : spec.entrySet()) {
                if (!ANNOTATIONS.contains(entry.getKey())) {
                    rules.add(entry);
                }
            }
            for (String keyword : spec.keySet()) {
                if (UNSUPPORTED.contains(keyword)) {
                    throw parseError(at, "$jsonSchema keyword '" + keyword + "' is not currently supported");
                }
            }
            if (spec.containsKey("type") && spec.containsKey("bsonType")) {
                throw parseError(at, "Cannot specify both $jsonSchema keywords 'type' and 'bsonType'");
            }
            this.title = optionalString(spec, "title", at);
            this.description = optionalString(spec, "description", at);
            if (spec.containsKey("bsonType")) {
                this.types = typeSet(spec.get("bsonType"), "bsonType", at);
                this.typeKeyword = "bsonType";
            } else if (spec.containsKey("type")) {
                this.types = typeSet(spec.get("type"), "type", at);
                this.typeKeyword = "type";
            } else {
                this.types = null;
                this.typeKeyword = null;
            }
            for (Map.Entry<String, Object> entry : spec.entrySet()) {
                String keyword = entry.getKey();
                Object value = entry.getValue();
                String here = at.isEmpty() ? keyword : at + "." + keyword;
                switch (keyword) {
                    case "title", "description", "bsonType", "type" -> {
                    }
                    case "enum" -> {
                        if (!(value instanceof List<?> values) || values.isEmpty()) {
                            throw parseError(at, "$jsonSchema keyword 'enum' must be a non-empty array");
                        }
                    }
                    case "minimum", "maximum" -> number(value, keyword, at);
                    case "exclusiveMinimum", "exclusiveMaximum" -> {
                        if (!(value instanceof Boolean)) {
                            throw parseError(at, "$jsonSchema keyword '" + keyword + "' must be a boolean");
                        }
                        String bound = keyword.equals("exclusiveMinimum") ? "minimum" : "maximum";
                        if (!spec.containsKey(bound)) {
                            throw parseError(at, "$jsonSchema keyword '" + bound + "' must be a present if "
                                    + keyword + " is present");
                        }
                    }
                    case "multipleOf" -> {
                        Number divisor = number(value, keyword, at);
                        if (ValueComparator.asc().compare(divisor, 0) <= 0) {
                            throw parseError(at, "$jsonSchema keyword 'multipleOf' must have a positive value");
                        }
                    }
                    case "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties" ->
                        count(value, keyword, at);
                    case "pattern" -> {
                        if (!(value instanceof String regex)) {
                            throw parseError(at, "$jsonSchema keyword 'pattern' must be a string");
                        }
                        this.pattern = regex(regex, at);
                    }
                    case "properties" -> {
                        for (Map.Entry<String, Object> property : document(value, keyword, at).entrySet()) {
                            properties.put(property.getKey(),
                                    new Node(document(property.getValue(), keyword, at), here + "." + property.getKey()));
                        }
                    }
                    case "required" -> {
                        if (!(value instanceof List<?> names) || names.isEmpty()) {
                            throw parseError(at, "$jsonSchema keyword 'required' must be a non-empty array");
                        }
                        Set<Object> seen = new LinkedHashSet<>();
                        for (Object name : names) {
                            if (!(name instanceof String) || !seen.add(name)) {
                                throw parseError(at, "$jsonSchema keyword 'required' must be an array of unique strings");
                            }
                        }
                    }
                    case "additionalProperties" -> {
                        if (value instanceof Boolean allowed) {
                            this.additionalPropertiesAllowed = allowed;
                        } else {
                            this.additionalPropertiesSchema = new Node(document(value, keyword, at), here);
                        }
                    }
                    case "patternProperties" -> {
                        for (Map.Entry<String, Object> property : document(value, keyword, at).entrySet()) {
                            patternProperties.put(regex(property.getKey(), at),
                                    new Node(document(property.getValue(), keyword, at), here + "." + property.getKey()));
                        }
                    }
                    case "dependencies" -> {
                        for (Map.Entry<String, Object> dependency : document(value, keyword, at).entrySet()) {
                            Object needed = dependency.getValue();
                            if (needed instanceof List<?> names) {
                                for (Object name : names) {
                                    if (!(name instanceof String)) {
                                        throw parseError(at, "property dependency lists must contain strings");
                                    }
                                }
                                dependencies.put(dependency.getKey(), names);
                            } else {
                                dependencies.put(dependency.getKey(),
                                        new Node(document(needed, keyword, at), here + "." + dependency.getKey()));
                            }
                        }
                    }
                    case "items" -> {
                        if (value instanceof List<?> schemas) {
                            itemsTuple = new ArrayList<>();
                            for (Object schema : schemas) {
                                itemsTuple.add(new Node(document(schema, keyword, at), here));
                            }
                        } else {
                            itemsSchema = new Node(document(value, keyword, at), here);
                        }
                    }
                    case "additionalItems" -> {
                        if (value instanceof Boolean allowed) {
                            this.additionalItemsAllowed = allowed;
                        } else {
                            this.additionalItemsSchema = new Node(document(value, keyword, at), here);
                        }
                    }
                    case "uniqueItems" -> {
                        if (!(value instanceof Boolean)) {
                            throw parseError(at, "$jsonSchema keyword 'uniqueItems' must be a boolean");
                        }
                    }
                    case "allOf", "anyOf", "oneOf" -> {
                        if (!(value instanceof List<?> schemas) || schemas.isEmpty()) {
                            throw parseError(at, "$jsonSchema keyword '" + keyword + "' must be a non-empty array");
                        }
                        List<Node> target = keyword.equals("allOf") ? allOf : keyword.equals("anyOf") ? anyOf : oneOf;
                        for (Object schema : schemas) {
                            target.add(new Node(document(schema, keyword, at), here));
                        }
                    }
                    case "not" -> this.not = new Node(document(value, keyword, at), here);
                    default -> throw parseError(at, "Unknown $jsonSchema keyword: " + keyword);
                }
            }
            Set<String> required = new LinkedHashSet<>();
            if (spec.get("required") instanceof List<?> names) {
                names.forEach(name -> required.add((String) name));
            }
            for (Map.Entry<String, Node> property : properties.entrySet()) {
                boolean needed = required.remove(property.getKey());
                fields.put(property.getKey(), new Field(property.getValue(), needed));
                if (needed) {
                    requiredDeclared += 1;
                }
            }
            requiredElsewhere.addAll(required);
            for (Map.Entry<String, Object> rule : rules) {
                if (!WHOLE.contains(rule.getKey())) {
                    others.add(rule);
                }
            }
            quick = spec.keySet().stream().allMatch(QUICK::contains) && itemsTuple == null;
        }

        /**
         * Whether {@code value} satisfies this schema: {@code check(value).isEmpty()}, decided in
         * one pass over a document's fields (a field's schema looked up once, where the rules
         * {@code properties}, {@code additionalProperties} and {@code required} each looked every
         * field up again: the validation of a rate limiter's document was a quarter of its
         * write). Schemas with keywords this pass does not know go through {@link #check}.
         */
        boolean holds(Object value) {
            if (!quick) {
                return check(value).isEmpty();
            }
            if (types != null && !typed(value)) {
                return false;
            }
            if (value instanceof Document doc) {
                int requiredSeen = 0;
                for (Map.Entry<String, Object> entry : doc.entrySet()) {
                    Field field = fields.get(entry.getKey());
                    if (field != null) {
                        if (!field.schema.holds(entry.getValue())) {
                            return false;
                        }
                        if (field.required) {
                            requiredSeen += 1;
                        }
                    } else if (Boolean.FALSE.equals(additionalPropertiesAllowed)) {
                        return false;
                    } else if (additionalPropertiesSchema != null && !additionalPropertiesSchema.holds(entry.getValue())) {
                        return false;
                    }
                }
                if (requiredSeen != requiredDeclared) {
                    return false;
                }
                for (String name : requiredElsewhere) {
                    if (!doc.containsKey(name)) {
                        return false;
                    }
                }
            }
            if (itemsSchema != null && value instanceof List<?> items) {
                for (Object item : items) {
                    if (!itemsSchema.holds(item)) {
                        return false;
                    }
                }
            }
            for (Map.Entry<String, Object> rule : others) {
                if (rule(rule.getKey(), rule.getValue(), value) != null) {
                    return false;
                }
            }
            return true;
        }

        /**
         * The failed rules of {@code value} (empty when it satisfies this schema). Every stored
         * document goes through here on every write, most of them passing: nothing is allocated
         * for a rule that holds.
         */
        List<Document> check(Object value) {
            List<Document> failures = null;
            for (Map.Entry<String, Object> entry : rules) {
                Document failure = rule(entry.getKey(), entry.getValue(), value);
                if (failure != null) {
                    if (failures == null) {
                        failures = new ArrayList<>();
                    }
                    failures.add(failure);
                }
            }
            return failures == null ? List.of() : failures;
        }

        private Document rule(String keyword, Object specified, Object value) {
            boolean number = value instanceof Number;
            boolean string = value instanceof String;
            boolean object = value instanceof Document;
            boolean array = value instanceof List;
            switch (keyword) {
                case "bsonType", "type" -> {
                    if (typed(value)) {
                        return null;
                    }
                    return failure(keyword, as(keyword, specified), "type did not match").append("consideredValue", value)
                            .append("consideredType", typeName(value));
                }
                case "enum" -> {
                    for (Object allowed : (List<?>) specified) {
                        if (equal(allowed, value)) {
                            return null;
                        }
                    }
                    return failure(keyword, as(keyword, specified), "value was not found in enum").append("consideredValue", value);
                }
                case "minimum", "maximum" -> {
                    if (!number) {
                        return null;
                    }
                    boolean exclusive = Boolean.TRUE.equals(spec.get(keyword.equals("minimum") ? "exclusiveMinimum"
                            : "exclusiveMaximum"));
                    int cmp = value instanceof Long a && specified instanceof Long b ? Long.compare(a, b)
                            : ValueComparator.asc().compare(value, specified);
                    boolean ok = keyword.equals("minimum") ? (exclusive ? cmp > 0 : cmp >= 0)
                            : (exclusive ? cmp < 0 : cmp <= 0);
                    if (ok) {
                        return null;
                    }
                    Document specifiedAs = as(keyword, specified);
                    if (exclusive) {
                        specifiedAs.append(keyword.equals("minimum") ? "exclusiveMinimum" : "exclusiveMaximum", true);
                    }
                    return failure(keyword, specifiedAs, "comparison failed").append("consideredValue", value);
                }
                case "multipleOf" -> {
                    if (!number || multipleOf((Number) value, (Number) specified)) {
                        return null;
                    }
                    return failure(keyword, as(keyword, specified), "considered value is not a multiple of the specified value")
                            .append("consideredValue", value);
                }
                case "minLength", "maxLength" -> {
                    if (!string) {
                        return null;
                    }
                    String text = (String) value;
                    long length = text.codePointCount(0, text.length());
                    long bound = ((Number) specified).longValue();
                    if (keyword.equals("minLength") ? length >= bound : length <= bound) {
                        return null;
                    }
                    return failure(keyword, as(keyword, specified), "specified string length was not satisfied")
                            .append("consideredValue", value);
                }
                case "pattern" -> {
                    if (!string || pattern.matcher((String) value).find()) {
                        return null;
                    }
                    return failure(keyword, as(keyword, specified), "regular expression did not match")
                            .append("consideredValue", value);
                }
                case "properties" -> {
                    if (!object) {
                        return null;
                    }
                    List<Document> failed = null;
                    Document doc = (Document) value;
                    for (Map.Entry<String, Node> property : properties.entrySet()) {
                        Object field = doc.get(property.getKey());
                        if (field == null && !doc.containsKey(property.getKey())) {
                            continue;
                        }
                        List<Document> details = property.getValue().check(field);
                        if (!details.isEmpty()) {
                            if (failed == null) {
                                failed = new ArrayList<>();
                            }
                            failed.add(property(property.getKey(), property.getValue(), details));
                        }
                    }
                    return failed == null ? null
                            : new Document("operatorName", keyword).append("propertiesNotSatisfied", failed);
                }
                case "required" -> {
                    if (!object) {
                        return null;
                    }
                    List<Object> missing = null;
                    for (Object name : (List<?>) specified) {
                        if (!((Document) value).containsKey((String) name)) {
                            if (missing == null) {
                                missing = new ArrayList<>();
                            }
                            missing.add(name);
                        }
                    }
                    return missing == null ? null
                            : new Document("operatorName", keyword).append("specifiedAs", as(keyword, specified))
                                    .append("missingProperties", missing);
                }
                case "additionalProperties" -> {
                    if (!object) {
                        return null;
                    }
                    List<Object> extra = new ArrayList<>();
                    List<Document> failed = new ArrayList<>();
                    for (Map.Entry<String, Object> field : ((Document) value).entrySet()) {
                        if (declared(field.getKey())) {
                            continue;
                        }
                        if (Boolean.FALSE.equals(additionalPropertiesAllowed)) {
                            extra.add(field.getKey());
                        } else if (additionalPropertiesSchema != null) {
                            List<Document> details = additionalPropertiesSchema.check(field.getValue());
                            if (!details.isEmpty()) {
                                failed.add(property(field.getKey(), additionalPropertiesSchema, details));
                            }
                        }
                    }
                    if (!extra.isEmpty()) {
                        return new Document("operatorName", keyword).append("specifiedAs", as(keyword, specified))
                                .append("additionalProperties", extra);
                    }
                    return failed.isEmpty() ? null
                            : new Document("operatorName", keyword).append("propertiesNotSatisfied", failed);
                }
                case "patternProperties" -> {
                    if (!object) {
                        return null;
                    }
                    List<Document> failed = new ArrayList<>();
                    for (Map.Entry<String, Object> field : ((Document) value).entrySet()) {
                        for (Map.Entry<Pattern, Node> rule : patternProperties.entrySet()) {
                            if (!rule.getKey().matcher(field.getKey()).find()) {
                                continue;
                            }
                            List<Document> details = rule.getValue().check(field.getValue());
                            if (!details.isEmpty()) {
                                failed.add(property(field.getKey(), rule.getValue(), details)
                                        .append("regexMatched", rule.getKey().pattern()));
                            }
                        }
                    }
                    return failed.isEmpty() ? null
                            : new Document("operatorName", keyword).append("propertiesNotSatisfied", failed);
                }
                case "minProperties", "maxProperties" -> {
                    if (!object) {
                        return null;
                    }
                    long count = ((Document) value).size();
                    long bound = ((Number) specified).longValue();
                    if (keyword.equals("minProperties") ? count >= bound : count <= bound) {
                        return null;
                    }
                    return failure(keyword, as(keyword, specified), "specified number of properties was not satisfied")
                            .append("numberOfProperties", count);
                }
                case "dependencies" -> {
                    if (!object) {
                        return null;
                    }
                    Document doc = (Document) value;
                    List<Document> failed = new ArrayList<>();
                    for (Map.Entry<String, Object> dependency : dependencies.entrySet()) {
                        if (!doc.containsKey(dependency.getKey())) {
                            continue;
                        }
                        if (dependency.getValue() instanceof Node schema) {
                            List<Document> details = schema.check(doc);
                            if (!details.isEmpty()) {
                                failed.add(new Document("conditionalProperty", dependency.getKey())
                                        .append("details", details));
                            }
                        } else {
                            List<Object> missing = new ArrayList<>();
                            for (Object name : (List<?>) dependency.getValue()) {
                                if (!doc.containsKey((String) name)) {
                                    missing.add(name);
                                }
                            }
                            if (!missing.isEmpty()) {
                                failed.add(new Document("conditionalProperty", dependency.getKey())
                                        .append("missingProperties", missing));
                            }
                        }
                    }
                    return failed.isEmpty() ? null
                            : new Document("operatorName", keyword).append("failingDependencies", failed);
                }
                case "items" -> {
                    if (!array) {
                        return null;
                    }
                    List<?> items = (List<?>) value;
                    if (itemsSchema != null) {
                        for (int i = 0; i < items.size(); i++) {
                            List<Document> details = itemsSchema.check(items.get(i));
                            if (!details.isEmpty()) {
                                return new Document("operatorName", keyword)
                                        .append("reason", "At least one item did not match the sub-schema")
                                        .append("itemIndex", i).append("details", details);
                            }
                        }
                        return null;
                    }
                    List<Document> failed = new ArrayList<>();
                    for (int i = 0; i < Math.min(items.size(), itemsTuple.size()); i++) {
                        List<Document> details = itemsTuple.get(i).check(items.get(i));
                        if (!details.isEmpty()) {
                            failed.add(new Document("index", i).append("details", details));
                        }
                    }
                    return failed.isEmpty() ? null
                            : new Document("operatorName", keyword).append("details", failed);
                }
                case "additionalItems" -> {
                    if (!array || itemsTuple == null) {
                        return null;
                    }
                    List<?> items = (List<?>) value;
                    for (int i = itemsTuple.size(); i < items.size(); i++) {
                        if (Boolean.FALSE.equals(additionalItemsAllowed)) {
                            return failure(keyword, as(keyword, specified), "found additional items")
                                    .append("additionalItems", new ArrayList<>(items.subList(itemsTuple.size(), items.size())));
                        }
                        if (additionalItemsSchema != null) {
                            List<Document> details = additionalItemsSchema.check(items.get(i));
                            if (!details.isEmpty()) {
                                return new Document("operatorName", keyword)
                                        .append("reason", "At least one additional item did not match the sub-schema")
                                        .append("itemIndex", i).append("details", details);
                            }
                        }
                    }
                    return null;
                }
                case "minItems", "maxItems" -> {
                    if (!array) {
                        return null;
                    }
                    long count = ((List<?>) value).size();
                    long bound = ((Number) specified).longValue();
                    if (keyword.equals("minItems") ? count >= bound : count <= bound) {
                        return null;
                    }
                    return failure(keyword, as(keyword, specified), "array did not match specified length")
                            .append("consideredValue", value);
                }
                case "uniqueItems" -> {
                    if (!array || !Boolean.TRUE.equals(specified)) {
                        return null;
                    }
                    List<?> items = (List<?>) value;
                    for (int i = 0; i < items.size(); i++) {
                        for (int j = 0; j < i; j++) {
                            if (equal(items.get(i), items.get(j))) {
                                return failure(keyword, as(keyword, specified), "found a duplicate item")
                                        .append("consideredValue", value).append("duplicatedValue", items.get(i));
                            }
                        }
                    }
                    return null;
                }
                case "allOf", "anyOf", "oneOf" -> {
                    List<Node> schemas = keyword.equals("allOf") ? allOf : keyword.equals("anyOf") ? anyOf : oneOf;
                    List<Document> failed = new ArrayList<>();
                    List<Object> matching = new ArrayList<>();
                    for (int i = 0; i < schemas.size(); i++) {
                        List<Document> details = schemas.get(i).check(value);
                        if (details.isEmpty()) {
                            matching.add(i);
                        } else {
                            failed.add(new Document("index", i).append("details", details));
                        }
                    }
                    boolean ok = switch (keyword) {
                        case "allOf" -> failed.isEmpty();
                        case "anyOf" -> !matching.isEmpty();
                        default -> matching.size() == 1;
                    };
                    if (ok) {
                        return null;
                    }
                    if (keyword.equals("oneOf") && matching.size() > 1) {
                        return new Document("operatorName", keyword).append("reason", "more than one subschema matched")
                                .append("matchingSchemaIndexes", matching);
                    }
                    return new Document("operatorName", keyword).append("schemasNotSatisfied", failed);
                }
                case "not" -> {
                    if (!not.check(value).isEmpty()) {
                        return null;
                    }
                    return new Document("operatorName", keyword).append("reason", "child expression matched")
                            .append("details", List.of());
                }
                default -> {
                    return null;
                }
            }
        }

        /** Whether {@code value} is of one of the types {@code bsonType} / {@code type} name. */
        private boolean typed(Object value) {
            return types.contains(typeName(value)) || (types.contains("number") && value instanceof Number);
        }

        private boolean declared(String name) {
            if (properties.containsKey(name)) {
                return true;
            }
            for (Pattern rule : patternProperties.keySet()) {
                if (rule.matcher(name).find()) {
                    return true;
                }
            }
            return false;
        }
    }

    /** A declared property: its schema, and whether the schema requires it. */
    private record Field(Node schema, boolean required) {
    }

    private static Document property(String name, Node schema, List<Document> details) {
        Document entry = new Document("propertyName", name);
        if (schema.title != null) {
            entry.put("title", schema.title);
        }
        if (schema.description != null) {
            entry.put("description", schema.description);
        }
        return entry.append("details", details);
    }

    /** What a failed rule says the schema specified; built only for a failure. */
    private static Document as(String keyword, Object specified) {
        return new Document(keyword, specified);
    }

    private static Document failure(String keyword, Document specifiedAs, String reason) {
        return new Document("operatorName", keyword).append("specifiedAs", specifiedAs).append("reason", reason);
    }

    /**
     * Whether {@code value} is a multiple of {@code divisor}, computed as MongoDB does: in decimal,
     * with a double first rounded to 15 significant digits.
     */
    private static boolean multipleOf(Number value, Number divisor) {
        if (isIntegral(value) && isIntegral(divisor)) {
            return value.longValue() % divisor.longValue() == 0;
        }
        BigDecimal a = decimal(value);
        BigDecimal b = decimal(divisor);
        if (a == null || b == null || b.signum() == 0) {
            return false;
        }
        return a.remainder(b).signum() == 0;
    }

    private static BigDecimal decimal(Number n) {
        if (n instanceof Decimal128 d) {
            try {
                return d.toBigDecimal();
            } catch (RuntimeException notFinite) {
                return null;
            }
        }
        if (isIntegral(n)) {
            return BigDecimal.valueOf(n.longValue());
        }
        double d = n.doubleValue();
        if (Double.isNaN(d) || Double.isInfinite(d)) {
            return null;
        }
        return new BigDecimal(d).round(FIFTEEN_DIGITS);
    }

    private static boolean isIntegral(Number n) {
        return n instanceof Integer || n instanceof Long || n instanceof Short || n instanceof Byte;
    }

    /**
     * Equality as {@code enum} and {@code uniqueItems} apply it: numbers by value across types,
     * documents without regard to field order (MongoDB's internal schema equality), arrays in order.
     */
    static boolean equal(Object a, Object b) {
        if (a instanceof Number na && b instanceof Number nb) {
            return ValueComparator.asc().compare(na, nb) == 0;
        }
        if (a instanceof Document da && b instanceof Document db) {
            if (!da.keySet().equals(db.keySet())) {
                return false;
            }
            for (String key : da.keySet()) {
                if (!equal(da.get(key), db.get(key))) {
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
                if (!equal(la.get(i), lb.get(i))) {
                    return false;
                }
            }
            return true;
        }
        if (a == null || b == null) {
            return a == b;
        }
        if (a instanceof BsonRegularExpression ra && b instanceof BsonRegularExpression rb) {
            return ra.getPattern().equals(rb.getPattern()) && String.valueOf(ra.getOptions()).equals(String.valueOf(rb.getOptions()));
        }
        return a.equals(b);
    }

    /** MongoDB's alias of a value's BSON type. */
    static String typeName(Object value) {
        if (value == null) {
            return "null";
        }
        if (value instanceof Double || value instanceof Float) {
            return "double";
        }
        if (value instanceof Integer || value instanceof Short || value instanceof Byte) {
            return "int";
        }
        if (value instanceof Long) {
            return "long";
        }
        if (value instanceof Decimal128) {
            return "decimal";
        }
        if (value instanceof String) {
            return "string";
        }
        if (value instanceof Document) {
            return "object";
        }
        if (value instanceof Collection) {
            return "array";
        }
        if (value instanceof BinData || value instanceof UUID || value instanceof LegacyUUID) {
            return "binData";
        }
        if (value instanceof ObjectId) {
            return "objectId";
        }
        if (value instanceof Boolean) {
            return "bool";
        }
        if (value instanceof Instant) {
            return "date";
        }
        if (value instanceof BsonRegularExpression) {
            return "regex";
        }
        if (value instanceof BsonJavaScript) {
            return "javascript";
        }
        if (value instanceof BsonTimestamp) {
            return "timestamp";
        }
        if (value instanceof MinKey) {
            return "minKey";
        }
        if (value instanceof MaxKey) {
            return "maxKey";
        }
        return value.getClass().getSimpleName();
    }

    private static final Set<String> BSON_TYPES = Set.of("double", "string", "object", "array", "binData",
            "undefined", "objectId", "bool", "date", "null", "regex", "dbPointer", "javascript", "symbol",
            "javascriptWithScope", "int", "timestamp", "long", "decimal", "minKey", "maxKey", "number");

    /** The bsonType aliases a {@code bsonType} or {@code type} keyword admits. */
    private static Set<String> typeSet(Object value, String keyword, String at) {
        List<Object> names = value instanceof List<?> list ? new ArrayList<>(list) : List.of(value);
        if (names.isEmpty()) {
            throw parseError(at, "$jsonSchema keyword '" + keyword + "' must name at least one type");
        }
        Set<String> types = new LinkedHashSet<>();
        for (Object name : names) {
            if (!(name instanceof String alias)) {
                throw parseError(at, "$jsonSchema keyword '" + keyword + "' must be a string or an array of strings");
            }
            if (keyword.equals("type")) {
                switch (alias) {
                    case "object", "array", "string", "null" -> types.add(alias);
                    case "number" -> types.add("number");
                    case "boolean" -> types.add("bool");
                    case "integer" -> throw parseError(at, "$jsonSchema type 'integer' is not currently supported.");
                    default -> throw parseError(at, "Unknown type name alias: " + alias);
                }
            } else {
                if (!BSON_TYPES.contains(alias)) {
                    throw parseError(at, "Unknown type name alias: " + alias);
                }
                types.add(alias);
            }
        }
        return types;
    }

    private static Number number(Object value, String keyword, String at) {
        if (!(value instanceof Number n)) {
            throw parseError(at, "$jsonSchema keyword '" + keyword + "' must be a number");
        }
        return n;
    }

    private static void count(Object value, String keyword, String at) {
        Number n = number(value, keyword, at);
        double d = n.doubleValue();
        if (d < 0 || d != Math.floor(d)) {
            throw parseError(at, "$jsonSchema keyword '" + keyword + "' must be a non-negative integral number");
        }
    }

    private static Document document(Object value, String keyword, String at) {
        if (!(value instanceof Document d)) {
            throw parseError(at, "$jsonSchema keyword '" + keyword + "' must be an object");
        }
        return d;
    }

    private static String optionalString(Document spec, String keyword, String at) {
        Object value = spec.get(keyword);
        if (value == null) {
            return null;
        }
        if (!(value instanceof String text)) {
            throw parseError(at, "$jsonSchema keyword '" + keyword + "' must be a string");
        }
        return text;
    }

    private static Pattern regex(String regex, String at) {
        try {
            return Pattern.compile(regex);
        } catch (PatternSyntaxException e) {
            throw parseError(at, "$jsonSchema regular expression '" + regex + "' is invalid: " + e.getDescription());
        }
    }

    private static MongoServerError parseError(String at, String message) {
        return new MongoServerError(9, "FailedToParse", at.isEmpty() ? message : message + " (at " + at + ")");
    }
}
