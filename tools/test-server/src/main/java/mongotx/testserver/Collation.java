package mongotx.testserver;

import java.text.Collator;
import java.util.List;
import java.util.Locale;
import java.util.Set;

import de.bwaldvogel.mongo.bson.Document;
import de.bwaldvogel.mongo.exception.MongoServerError;

/**
 * Collations: a collection's default one (given to {@code create}) and the one a command names,
 * in force while the command runs (https://www.mongodb.com/docs/manual/reference/collation/: an
 * operation on a collection uses the collection's collation unless it names one of its own, and
 * {@code {locale: "simple"}} is the binary comparison).
 *
 * <p>The test server plays them where mongotx depends on them: string values compared by
 * aggregation expressions ({@code $eq}, {@code $lt}, {@code $cmp}, ... inside {@code $expr}, as a
 * plain document's content condition compares) and sorts, through the server's
 * {@code ValueComparator}, with Java's collator for the locale at the given strength (1: letters
 * only, 2: letters and accents, 3 and above: case too). Query equality and {@code $in} in a filter
 * stay binary, as do field names and indexes; {@code $indexOfBytes} and {@code $strLenBytes} work on
 * bytes under any collation, as on MongoDB.
 */
public final class Collation {

    private static final ThreadLocal<Collator> CURRENT = new ThreadLocal<>();
    private static final Set<String> OPTIONS = Set.of("locale", "strength", "caseLevel", "caseFirst",
            "numericOrdering", "alternate", "maxVariable", "backwards", "normalization");

    private Collation() {
    }

    /** The collator of the command running on this thread; null for the binary comparison. */
    public static Collator current() {
        return CURRENT.get();
    }

    /**
     * Runs {@code body} with the collation {@code command} names (its own {@code collation}, or its
     * first statement's), else {@code collectionDefault}, in force.
     */
    static <T> T during(Document command, Collator collectionDefault, java.util.function.Supplier<T> body) {
        Object named = command.get("collation");
        for (String statements : List.of("updates", "deletes")) {
            if (named == null && command.get(statements) instanceof List<?> list && !list.isEmpty()
                    && list.get(0) instanceof Document first) {
                named = first.get("collation");
            }
        }
        Collator collator = named instanceof Document spec ? of(spec) : collectionDefault;
        Collator before = CURRENT.get();
        CURRENT.set(collator);
        try {
            return body.get();
        } finally {
            CURRENT.set(before);
        }
    }

    /** The collator of a collation document; null for {@code {locale: "simple"}}. */
    static Collator of(Document spec) {
        for (String key : spec.keySet()) {
            if (!OPTIONS.contains(key)) {
                throw new MongoServerError(40415, "Location40415", "BSON field 'collation." + key + "' is an unknown field.");
            }
        }
        if (!(spec.get("locale") instanceof String locale)) {
            throw new MongoServerError(40414, "Location40414", "BSON field 'collation.locale' is missing but a required field");
        }
        if (locale.equals("simple")) {
            return null;
        }
        int strength = spec.get("strength") instanceof Number n ? n.intValue() : 3;
        if (strength < 1 || strength > 5) {
            throw new MongoServerError(51024, "Location51024", "unable to parse collation :: caused by :: strength must be between 1 and 5");
        }
        Collator collator = Collator.getInstance(Locale.forLanguageTag(locale.replace('_', '-')));
        collator.setStrength(switch (strength) {
            case 1 -> Collator.PRIMARY;
            case 2 -> Collator.SECONDARY;
            default -> Collator.TERTIARY;
        });
        return collator;
    }

    /** Compares two string values under the collation in force (binary when there is none). */
    public static int compare(String a, String b, java.util.Comparator<String> binary) {
        Collator collator = CURRENT.get();
        if (collator == null) {
            return binary.compare(a, b);
        }
        return collator.compare(a, b);
    }
}
