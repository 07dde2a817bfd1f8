package mongotx.testserver;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;

import de.bwaldvogel.mongo.backend.DefaultQueryMatcher;
import de.bwaldvogel.mongo.backend.Index;
import de.bwaldvogel.mongo.backend.IndexKey;
import de.bwaldvogel.mongo.backend.Missing;
import de.bwaldvogel.mongo.backend.OperatorUpdates;
import de.bwaldvogel.mongo.backend.Utils;
import de.bwaldvogel.mongo.backend.DatabaseResolver;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.bson.ObjectId;
import de.bwaldvogel.mongo.exception.MongoServerError;
import de.bwaldvogel.mongo.exception.MongoServerException;
import de.bwaldvogel.mongo.oplog.Oplog;

/**
 * The write commands ({@code insert}, {@code update}, {@code delete}, {@code findAndModify}) as
 * MongoDB runs them, over mongo-java-server's storage and indexes.
 *
 * <p>For each statement: one {@code $$NOW} (the collection's clock, read once); the matching
 * documents read, their new versions computed (update operators, a replacement, or a pipeline) and
 * checked against the collection's validator, and stored, all under the collection's lock, so that
 * nothing changes a document between the read and the write; an upsert seeded from the filter's
 * equalities. A statement that fails (a refused document, a duplicate key, an expression that
 * cannot be evaluated) is that statement's write error: an ordered command stops there, an
 * unordered one goes on. Duplicate-key errors carry {@code keyPattern} and {@code keyValue}, and
 * validation failures {@code errInfo} (5.0+), as in MongoDB
 * (https://www.mongodb.com/docs/manual/reference/command/insert/#output).
 */
final class Writes {

    /** A write refused by the collection's validator (code 121). */
    static final class ValidationFailure extends MongoServerError {
        private static final long serialVersionUID = 1L;
        final Document errInfo;

        ValidationFailure(Object id, Document details) {
            super(121, "DocumentValidationFailure", "Document failed validation");
            this.errInfo = new Document("failingDocumentId", id).append("details", details);
        }
    }

    /** What one update statement did. */
    private static final class Outcome {
        int matched;
        int modified;
        Object upserted;
        boolean didUpsert;
        Document newDocument;
        Document oldDocument;
    }

    private final AtomicDatabase database;
    private final Profile profile;
    private final Clocks clocks;

    Writes(AtomicDatabase database, Profile profile, Clocks clocks) {
        this.database = database;
        this.profile = profile;
        this.clocks = clocks;
    }

    // ---- insert ----

    Document insert(Document command) {
        String name = String.valueOf(command.get("insert"));
        List<?> documents = list(command, "documents", "insert");
        boolean ordered = !Boolean.FALSE.equals(command.get("ordered"));
        boolean bypass = Boolean.TRUE.equals(command.get("bypassDocumentValidation"));
        AtomicCollection collection = database.collectionForWrite(name);
        int inserted = 0;
        List<Document> errors = new ArrayList<>();
        for (int i = 0; i < documents.size(); i++) {
            Document document = null;
            try {
                if (!(documents.get(i) instanceof Document given)) {
                    throw new MongoServerError(14, "TypeMismatch", "documents to insert must be objects");
                }
                document = withId(given);
                validate(collection, document, null, bypass);
                collection.addDocument(document);
                inserted += 1;
            } catch (MongoServerException | ClassCastException | IllegalArgumentException e) {
                errors.add(writeError(i, e, collection, document));
                if (ordered) {
                    break;
                }
            }
        }
        return reply(new Document("n", inserted), errors);
    }

    /** The document with its {@code _id} first, generated when absent (as MongoDB stores it). */
    private static Document withId(Document given) {
        Document document = new Document("_id", given.containsKey("_id") ? given.get("_id") : new ObjectId());
        for (Map.Entry<String, Object> entry : given.entrySet()) {
            if (!entry.getKey().equals("_id")) {
                document.put(entry.getKey(), entry.getValue());
            }
        }
        return document;
    }

    // ---- update ----

    Document update(Document command, DatabaseResolver resolver, Oplog oplog) {
        String name = String.valueOf(command.get("update"));
        List<?> statements = list(command, "updates", "update");
        boolean ordered = !Boolean.FALSE.equals(command.get("ordered"));
        boolean bypass = Boolean.TRUE.equals(command.get("bypassDocumentValidation"));
        Document let = let(command, "update");
        int matched = 0;
        int modified = 0;
        List<Document> upserted = new ArrayList<>();
        List<Document> errors = new ArrayList<>();
        for (int i = 0; i < statements.size(); i++) {
            Outcome outcome = new Outcome();
            AtomicCollection collection = null;
            try {
                if (!(statements.get(i) instanceof Document statement)) {
                    throw new MongoServerError(14, "TypeMismatch", "update statements must be objects");
                }
                boolean upsert = Boolean.TRUE.equals(statement.get("upsert"));
                collection = upsert ? database.collectionForWrite(name) : database.existing(name);
                Variables variables = Variables.of(clocks.now(name), let);
                update(collection, statement, variables, bypass, resolver, oplog, outcome);
                if (outcome.didUpsert) {
                    upserted.add(new Document("index", i).append("_id", outcome.upserted));
                }
                // A statement that failed counts in neither total, as in MongoDB: its result is
                // its write error (the documents it matched before failing are not reported).
                matched += outcome.matched;
                modified += outcome.modified;
            } catch (MongoServerException | ClassCastException | IllegalArgumentException e) {
                errors.add(writeError(i, e, collection, outcome.newDocument));
                if (ordered) {
                    break;
                }
            }
        }
        Document reply = new Document("n", matched + upserted.size()).append("nModified", modified);
        if (!upserted.isEmpty()) {
            reply.put("upserted", upserted);
        }
        return reply(reply, errors);
    }

    private void update(AtomicCollection collection, Document statement, Variables variables, boolean bypass,
            DatabaseResolver resolver, Oplog oplog, Outcome outcome) {
        if (!statement.containsKey("q")) {
            throw new MongoServerError(40414, "Location40414",
                    "BSON field 'update.updates.q' is missing but a required field");
        }
        if (!statement.containsKey("u")) {
            throw new MongoServerError(40414, "Location40414",
                    "BSON field 'update.updates.u' is missing but a required field");
        }
        Document filter = variables.inFilter(document(statement.get("q"), "q"));
        Object update = statement.get("u");
        boolean multi = Boolean.TRUE.equals(statement.get("multi"));
        boolean upsert = Boolean.TRUE.equals(statement.get("upsert"));
        checkUpdate(update, multi);
        if (collection == null) {
            return;
        }
        synchronized (collection) {
            List<Document> found = collection.stored(filter, null, multi ? 0 : 1);
            for (Document old : found) {
                outcome.oldDocument = old;
                Document next = compute(collection, old, update, statement, filter, variables, false, resolver, oplog);
                outcome.newDocument = next;
                outcome.matched += 1;
                if (!next.equals(old)) {
                    validate(collection, next, old, bypass);
                    collection.replace(old.get("_id"), old, next);
                    outcome.modified += 1;
                }
            }
            if (found.isEmpty() && upsert) {
                Document created = upsert(collection, filter, update, statement, variables, resolver, oplog);
                outcome.newDocument = created;
                validate(collection, created, null, bypass);
                collection.addDocument(created);
                outcome.didUpsert = true;
                outcome.upserted = created.get("_id");
            }
        }
    }

    /** Refuses what MongoDB refuses before looking at any document. */
    private static void checkUpdate(Object update, boolean multi) {
        if (update instanceof List<?> stages) {
            UpdatePipeline.check(stages);
            return;
        }
        if (!(update instanceof Document document)) {
            throw new MongoServerError(14, "TypeMismatch", "Update argument must be either an object or an array");
        }
        if (!isOperatorUpdate(document)) {
            if (multi) {
                throw new MongoServerError(9, "FailedToParse", "multi update is not supported for replacement-style update");
            }
            for (String key : document.keySet()) {
                if (key.startsWith("$")) {
                    throw new MongoServerError(52, "DollarPrefixedFieldName", "The dollar ($) prefixed field '" + key
                            + "' in '" + key + "' is not valid for storage.");
                }
            }
        }
    }

    /** Whether an operator update names a path through the positional operator ({@code a.$.b}). */
    private static boolean positional(Document update) {
        for (Object fields : update.values()) {
            if (fields instanceof Document paths) {
                for (String path : paths.keySet()) {
                    for (String part : path.split("\\.")) {
                        if (part.equals("$")) {
                            return true;
                        }
                    }
                }
            }
        }
        return false;
    }

    private static boolean isOperatorUpdate(Document update) {
        return !update.isEmpty() && update.keySet().iterator().next().startsWith("$");
    }

    /** What {@code update} makes of the stored document {@code old} (a copy; nothing is stored). */
    private Document compute(AtomicCollection collection, Document old, Object update, Document statement,
            Document filter, Variables variables, boolean upsert, DatabaseResolver resolver, Oplog oplog) {
        if (update instanceof List<?> stages) {
            return UpdatePipeline.apply(old, stages, variables, database, collection, resolver, oplog);
        }
        Document document = (Document) update;
        Document next;
        if (isOperatorUpdate(document)) {
            // Only the positional operator (`a.$`) uses where the filter matched an array; working
            // it out re-runs the whole filter on the document.
            Integer position = upsert || !positional(document) ? null
                    : new DefaultQueryMatcher().matchPosition(old, filter);
            next = OperatorUpdates.apply(old, variables.inOperatorUpdate(document), statement, position, upsert,
                    profile.acceptsEmptyOperands());
        } else {
            next = new Document();
            if (old.containsKey("_id")) {
                next.put("_id", old.get("_id"));
            }
            for (Map.Entry<String, Object> entry : document.entrySet()) {
                next.put(entry.getKey(), entry.getValue());
            }
            next = Copies.deep(next);
        }
        if (old.containsKey("_id") && next.containsKey("_id") && !JsonSchema.equal(old.get("_id"), next.get("_id"))) {
            throw new MongoServerError(66, "ImmutableField",
                    "Performing an update on the path '_id' would modify the immutable field '_id'");
        }
        if (old.containsKey("_id") && !next.containsKey("_id")) {
            Document withId = new Document("_id", old.get("_id"));
            next.forEach(withId::putIfAbsent);
            next = withId;
        }
        return next;
    }

    /** The document an upsert inserts when its filter matched nothing. */
    private Document upsert(AtomicCollection collection, Document filter, Object update, Document statement,
            Variables variables, DatabaseResolver resolver, Oplog oplog) {
        Document seed = UpsertSeed.of(filter);
        Document created;
        if (update instanceof Document replacement && !isOperatorUpdate(replacement)) {
            created = new Document();
            if (seed.containsKey("_id")) {
                created.put("_id", seed.get("_id"));
            }
            for (Map.Entry<String, Object> entry : replacement.entrySet()) {
                if (entry.getKey().equals("_id") && created.containsKey("_id")
                        && !JsonSchema.equal(created.get("_id"), entry.getValue())) {
                    throw new MongoServerError(66, "ImmutableField",
                            "Performing an update on the path '_id' would modify the immutable field '_id'");
                }
                created.put(entry.getKey(), entry.getValue());
            }
            created = Copies.deep(created);
        } else {
            created = compute(collection, seed, update, statement, filter, variables, true, resolver, oplog);
        }
        return withId(created);
    }

    // ---- delete ----

    Document delete(Document command, Oplog oplog) {
        String name = String.valueOf(command.get("delete"));
        List<?> statements = list(command, "deletes", "delete");
        boolean ordered = !Boolean.FALSE.equals(command.get("ordered"));
        Document let = let(command, "delete");
        AtomicCollection collection = database.existing(name);
        int deleted = 0;
        List<Document> errors = new ArrayList<>();
        for (int i = 0; i < statements.size(); i++) {
            try {
                if (!(statements.get(i) instanceof Document statement)) {
                    throw new MongoServerError(14, "TypeMismatch", "delete statements must be objects");
                }
                if (!statement.containsKey("q") || !statement.containsKey("limit")) {
                    throw new MongoServerError(40414, "Location40414", "BSON field 'delete.deletes."
                            + (statement.containsKey("q") ? "limit" : "q") + "' is missing but a required field");
                }
                int limit = ((Number) statement.get("limit")).intValue();
                if (limit != 0 && limit != 1) {
                    throw new MongoServerError(9, "FailedToParse", "The limit field in delete objects must be 0 or 1. Got "
                            + limit);
                }
                Document filter = Variables.of(clocks.now(name), let).inFilter(document(statement.get("q"), "q"));
                if (collection != null) {
                    deleted += collection.deleteDocuments(new Document("$query", filter), limit, oplog);
                }
            } catch (MongoServerException | ClassCastException | IllegalArgumentException e) {
                errors.add(writeError(i, e, collection, null));
                if (ordered) {
                    break;
                }
            }
        }
        return reply(new Document("n", deleted), errors);
    }

    // ---- findAndModify ----

    Document findAndModify(Document command, DatabaseResolver resolver, Oplog oplog) {
        String name = String.valueOf(command.containsKey("findAndModify") ? command.get("findAndModify")
                : command.get("findandmodify"));
        boolean remove = Boolean.TRUE.equals(command.get("remove"));
        boolean returnNew = Boolean.TRUE.equals(command.get("new"));
        boolean upsert = Boolean.TRUE.equals(command.get("upsert"));
        boolean bypass = Boolean.TRUE.equals(command.get("bypassDocumentValidation"));
        Object update = command.get("update");
        if (remove == (update != null)) {
            throw new MongoServerError(9, "FailedToParse", remove
                    ? "Cannot specify both an update and remove=true"
                    : "Either an update or remove=true must be specified");
        }
        if (remove && (upsert || returnNew)) {
            throw new MongoServerError(9, "FailedToParse", "Cannot specify both upsert=true and remove=true");
        }
        Document fields = command.get("fields") instanceof Document f ? f : null;
        Document sort = command.get("sort") instanceof Document s ? s : null;
        Variables variables = Variables.of(clocks.now(name), let(command, "findAndModify"));
        Document filter = variables.inFilter(command.get("query") instanceof Document q ? q : new Document());
        if (update != null) {
            checkUpdate(update, false);
        }
        AtomicCollection collection = upsert ? database.collectionForWrite(name) : database.existing(name);
        Document lastError = new Document("n", 0);
        if (!remove) {
            lastError.put("updatedExisting", Boolean.FALSE);
        }
        Document value = null;
        Document candidate = null;
        try {
            if (collection != null) {
                synchronized (collection) {
                    List<Document> found = collection.stored(filter, sort, 1);
                    if (!found.isEmpty()) {
                        Document old = found.get(0);
                        if (remove) {
                            value = Copies.deep(old);
                            collection.deleteDocuments(new Document("$query", new Document("_id", old.get("_id"))), 1,
                                    oplog);
                            lastError = new Document("n", 1);
                        } else {
                            Document next = compute(collection, old, update, command, filter, variables, false,
                                    resolver, oplog);
                            candidate = next;
                            // The pre-image is copied before the stored document changes; a
                            // post-image is the computed document, which nothing stored shares.
                            Document before = returnNew ? null : Copies.deep(old);
                            if (!next.equals(old)) {
                                validate(collection, next, old, bypass);
                                collection.replace(old.get("_id"), old, next);
                            }
                            lastError = new Document("n", 1).append("updatedExisting", Boolean.TRUE);
                            value = returnNew ? next : before;
                        }
                    } else if (upsert) {
                        Document created = upsert(collection, filter, update, command, variables, resolver, oplog);
                        candidate = created;
                        validate(collection, created, null, bypass);
                        collection.addDocument(created);
                        lastError = new Document("n", 1).append("updatedExisting", Boolean.FALSE)
                                .append("upserted", created.get("_id"));
                        // The copy is taken before the lock goes: an upserted document is the
                        // stored object itself, which the next update changes in place, so a copy
                        // taken after could answer with another caller's write (two increments of
                        // a counter both answered with the second's value).
                        value = returnNew ? Copies.deep(created) : null;
                    }
                }
            }
        } catch (ValidationFailure e) {
            return commandError(e, collection, candidate);
        } catch (MongoServerError e) {
            if (e.getCode() == 11000) {
                return commandError(e, collection, candidate);
            }
            throw e;
        }
        Document reply = new Document("lastErrorObject", lastError);
        reply.put("value", value == null ? null : Projection.apply(value, fields));
        return reply.append("ok", 1.0);
    }

    // ---- shared ----

    /** Whether {@code candidate} may be written; throws the validation failure if not. */
    private void validate(AtomicCollection collection, Document candidate, Document original, boolean bypass) {
        Validator validator = database.validator(collection.getCollectionName());
        if (validator == null || bypass || !validator.enabled()) {
            return;
        }
        // The candidate first: most writes pass, and then the original's validity does not matter.
        Document details = validator.explain(candidate);
        if (details == null || validator.warnsOnly()) {
            return;
        }
        if (original != null && validator.skipsInvalidOriginals() && validator.explain(original) != null) {
            return;
        }
        throw new ValidationFailure(candidate.get("_id"), details);
    }

    private Document let(Document command, String commandName) {
        if (!command.containsKey("let")) {
            return null;
        }
        if (!profile.acceptsLet()) {
            throw new MongoServerError(40415, "Location40415", "BSON field '" + commandName + ".let' is an unknown field.");
        }
        return document(command.get("let"), "let");
    }

    /** A statement's write error, in MongoDB's shape. */
    private Document writeError(int index, Exception failure, AtomicCollection collection, Document offending) {
        Document error = new Document("index", index);
        error.putAll(errorFields(failure, collection, offending));
        return error;
    }

    /** A whole command's error reply carrying the same fields a write error would. */
    private Document commandError(MongoServerError failure, AtomicCollection collection, Document offending) {
        Document reply = new Document("ok", 0.0);
        reply.putAll(errorFields(failure, collection, offending));
        return reply;
    }

    private Document errorFields(Exception failure, AtomicCollection collection, Document offending) {
        Document fields = new Document();
        if (failure instanceof MongoServerError error) {
            fields.put("code", error.getCode());
            fields.put("codeName", error.getCodeName() != null ? error.getCodeName() : "Location" + error.getCode());
            fields.put("errmsg", error.getMessageWithoutErrorCode());
            if (error instanceof ValidationFailure refused && profile.explainsValidation()) {
                fields.put("errInfo", refused.errInfo);
            }
            if (error.getCode() == 11000) {
                fields.putAll(duplicateKey(error, collection, offending));
            }
        } else if (failure instanceof MongoServerException error) {
            fields.put("code", 2);
            fields.put("codeName", "BadValue");
            fields.put("errmsg", error.getMessageWithoutErrorCode());
        } else {
            fields.put("code", 2);
            fields.put("codeName", "BadValue");
            fields.put("errmsg", String.valueOf(failure.getMessage()));
        }
        return fields;
    }

    /** {@code keyPattern} and {@code keyValue} of a duplicate-key error, from the index its message names. */
    private static Document duplicateKey(MongoServerError error, AtomicCollection collection, Document offending) {
        Document fields = new Document();
        String message = error.getMessageWithoutErrorCode();
        int at = message.indexOf(" index: ");
        if (collection == null || offending == null || at < 0) {
            return fields;
        }
        String rest = message.substring(at + " index: ".length());
        int end = rest.indexOf(' ');
        String name = end < 0 ? rest : rest.substring(0, end);
        Index<Integer> index = collection.index(name);
        if (index == null) {
            return fields;
        }
        Document pattern = new Document();
        Document values = new Document();
        for (IndexKey key : index.getKeys()) {
            pattern.put(key.getKey(), key.isAscending() ? 1 : -1);
            Object value = Utils.getSubdocumentValue(offending, key.getKey());
            values.put(key.getKey(), value instanceof Missing ? null : value);
        }
        return fields.append("keyPattern", pattern).append("keyValue", values);
    }

    private static Document reply(Document reply, List<Document> errors) {
        if (!errors.isEmpty()) {
            reply.put("writeErrors", errors);
        }
        return reply.append("ok", 1.0);
    }

    private static List<?> list(Document command, String field, String commandName) {
        Object value = command.get(field);
        if (!(value instanceof List<?> list)) {
            throw new MongoServerError(40414, "Location40414", "BSON field '" + commandName + "." + field
                    + "' is missing but a required field");
        }
        return list;
    }

    private static Document document(Object value, String field) {
        if (value == null) {
            return new Document();
        }
        if (!(value instanceof Document d)) {
            throw new MongoServerError(14, "TypeMismatch", "BSON field '" + field + "' is the wrong type, expected an object");
        }
        return d;
    }
}
