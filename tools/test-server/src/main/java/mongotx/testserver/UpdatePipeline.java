package mongotx.testserver;

import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.stream.Stream;

import de.bwaldvogel.mongo.MongoDatabase;
import de.bwaldvogel.mongo.backend.DatabaseResolver;
import de.bwaldvogel.mongo.backend.aggregation.Aggregation;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;
import de.bwaldvogel.mongo.oplog.Oplog;

/**
 * An update given as an aggregation pipeline (MongoDB 4.2+,
 * https://www.mongodb.com/docs/manual/tutorial/update-documents-with-aggregation-pipeline/), run
 * over one document: the stages an update allows ({@code $addFields} / {@code $set},
 * {@code $project} / {@code $unset}, {@code $replaceRoot} / {@code $replaceWith}), with the
 * statement's variables, by the aggregation engine. As in MongoDB the result keeps the document's
 * {@code _id} when a stage drops it, and may not change it.
 */
final class UpdatePipeline {

    private static final Set<String> ALLOWED = Set.of("$addFields", "$set", "$project", "$unset", "$replaceRoot",
            "$replaceWith");

    private UpdatePipeline() {
    }

    /** Checks the stages before anything runs: a pipeline update names only the stages MongoDB allows. */
    static void check(List<?> stages) {
        for (Object item : stages) {
            if (!(item instanceof Document stage) || stage.size() != 1) {
                throw new MongoServerError(14, "TypeMismatch", "Each element of the 'pipeline' array must be an object");
            }
            String name = stage.keySet().iterator().next();
            if (!ALLOWED.contains(name)) {
                throw new MongoServerError(72, "InvalidOptions", name + " is not allowed to be used within an update");
            }
        }
    }

    /** The document {@code stages} make of a copy of {@code document}. */
    static Document apply(Document document, List<?> stages, Variables variables, MongoDatabase database,
            AtomicCollection collection, DatabaseResolver resolver, Oplog oplog) {
        check(stages);
        Aggregation aggregation = Aggregation.fromPipeline((Object) variables.inPipeline(stages), resolver, database,
                collection, oplog);
        // The stages run on a copy: `$$ROOT` is the document they are given, so a stage can put
        // the document itself into its result ({x: "$$ROOT"}), and replacing the stored document
        // changes that very object. A copy of its own map is enough: no stage an update may run
        // changes what it is given ($set, $unset and $replaceWith build their results from
        // copies of the maps they change, $project builds or deep-copies, and no expression
        // changes its arguments), and replacing the stored document stores copies of every value
        // (AtomicCollection.replace), so the values the result shares with the stored document are
        // never written through. A deep copy here was a sixth of a rate limiter's write.
        List<Document> out = aggregation.runStages(Stream.of(Copies.shallow(document)));
        if (out.size() != 1) {
            throw new MongoServerError(2, "BadValue", "an update pipeline must produce exactly one document");
        }
        Document result = out.get(0);
        Object id = document.get("_id");
        if (!result.containsKey("_id")) {
            if (!document.containsKey("_id")) {
                return result;
            }
        } else if (document.containsKey("_id") && !JsonSchema.equal(result.get("_id"), id)) {
            throw new MongoServerError(66, "ImmutableField",
                    "Performing an update on the path '_id' would modify the immutable field '_id'");
        }
        Document ordered = new Document("_id", result.containsKey("_id") ? result.get("_id") : id);
        for (Map.Entry<String, Object> entry : result.entrySet()) {
            if (!entry.getKey().equals("_id")) {
                ordered.put(entry.getKey(), entry.getValue());
            }
        }
        return ordered;
    }
}
