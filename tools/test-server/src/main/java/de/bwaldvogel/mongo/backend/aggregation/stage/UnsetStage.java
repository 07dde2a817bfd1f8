package de.bwaldvogel.mongo.backend.aggregation.stage;

import java.util.ArrayList;
import java.util.Collection;
import java.util.List;
import java.util.stream.Stream;

import de.bwaldvogel.mongo.backend.Utils;
import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;
import mongotx.testserver.Copies;

/**
 * The mongotx test server's replacement for mongo-java-server's {@code $unset} stage (the shaded jar
 * leaves the original out, see pom.xml). It removes the same paths
 * (https://www.mongodb.com/docs/manual/reference/operator/aggregation/unset/) but copies only what
 * it changes: the document's own map and the top-level fields a dotted path goes into. The original
 * copied the whole document, every embedded document and array, for every document of every stage.
 */
public class UnsetStage implements AggregationStage {

    private final List<String> paths = new ArrayList<>();

    public UnsetStage(Object input) {
        if (input instanceof Collection<?> list) {
            for (Object path : list) {
                add(path);
            }
        } else {
            add(input);
        }
    }

    private void add(Object path) {
        if (!(path instanceof String text)) {
            throw new MongoServerError(31120,
                    "$unset specification must be a string or an array containing only string values");
        }
        if (text.isEmpty()) {
            throw new MongoServerError(40352,
                    "Invalid $unset :: caused by :: FieldPath cannot be constructed with empty string");
        }
        paths.add(text);
    }

    @Override
    public String name() {
        return "$unset";
    }

    @Override
    public Stream<Document> apply(Stream<Document> stream) {
        return stream.map(this::unset);
    }

    private Document unset(Document document) {
        Document result = Copies.shallow(document);
        for (String path : paths) {
            int dot = path.indexOf('.');
            if (dot < 0) {
                result.remove(path);
                continue;
            }
            String top = path.substring(0, dot);
            if (result.containsKey(top)) {
                result.put(top, Copies.deepValue(result.get(top)));
            }
            Utils.removeSubdocumentValue(result, path);
        }
        return result;
    }
}
