package de.bwaldvogel.mongo.backend;

import java.math.BigDecimal;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Collection;
import java.util.Comparator;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.UUID;

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

/**
 * The mongotx test server's replacement for mongo-java-server's value comparator (the shaded jar
 * leaves the original out; see pom.xml). Every sort, query comparison and aggregation comparison of
 * the server goes through this class, so this is where the server follows MongoDB's BSON comparison
 * order (https://www.mongodb.com/docs/manual/reference/bson-type-comparison-order/):
 *
 * <ul>
 * <li>Strings compare by their UTF-8 bytes (the simple binary collation), not by UTF-16 code units:
 * a character above U+FFFF sorts after U+E000..U+FFFF, as in MongoDB; string values compare under
 * the collation of the command running, where it has one ({@code mongotx.testserver.Collation}).
 * <li>In sorts and query comparisons ({@link #asc()}, {@link #desc()}) a missing field is null. In
 * aggregation expressions ({@link #ascWithoutListHandling()}: {@code $eq}, {@code $lt}, {@code $cmp}...)
 * a missing field sorts before null and is not equal to it, as MongoDB's expression evaluator has it.
 * <li>Numbers of every type compare exactly by value (a long against a double with a fraction, large
 * longs beyond a double's precision, decimals); NaN is below every other number and equal to itself.
 * <li>Documents compare field by field (type of the value, then name, then value); arrays element by
 * element, or, in sorts, by their smallest (ascending) or largest (descending) element.
 * </ul>
 */
public class ValueComparator implements Comparator<Object> {

    private static final ValueComparator ASCENDING = new ValueComparator(true, true);
    private static final ValueComparator DESCENDING = new ValueComparator(false, true);
    private static final ValueComparator EXPRESSIONS = new ValueComparator(true, false);

    private final boolean ascending;
    /** Sort semantics: arrays by their extreme element, missing as null. Otherwise expression semantics. */
    private final boolean sorting;

    private ValueComparator(boolean ascending, boolean sorting) {
        this.ascending = ascending;
        this.sorting = sorting;
    }

    /** Ascending sort and query order. */
    public static ValueComparator asc() {
        return ASCENDING;
    }

    /** Descending sort and query order. */
    public static ValueComparator desc() {
        return DESCENDING;
    }

    /** The order of aggregation expressions: arrays element-wise, missing below null. */
    public static ValueComparator ascWithoutListHandling() {
        return EXPRESSIONS;
    }

    @Override
    public ValueComparator reversed() {
        if (!sorting) {
            throw new UnsupportedOperationException("the expression order has no reverse");
        }
        return ascending ? DESCENDING : ASCENDING;
    }

    @Override
    public int compare(Object a, Object b) {
        int cmp = sorting ? compareForSort(a, b) : compareValues(a, b, false);
        return ascending ? cmp : -cmp;
    }

    /**
     * Compares the canonical types of two values (MongoDB's order of BSON types); a missing value and
     * null share a rank. Used by the {@code $min} / {@code $max} update operators.
     */
    static int compareTypes(Object a, Object b) {
        return Integer.compare(rank(a, true), rank(b, true));
    }

    private int compareForSort(Object a, Object b) {
        boolean listA = a instanceof Collection;
        boolean listB = b instanceof Collection;
        if (listA || listB) {
            Object keyA = listA ? sortKey((Collection<?>) a) : a;
            Object keyB = listB ? sortKey((Collection<?>) b) : b;
            // An empty array sorts below null and missing.
            boolean emptyA = listA && ((Collection<?>) a).isEmpty();
            boolean emptyB = listB && ((Collection<?>) b).isEmpty();
            if (emptyA || emptyB) {
                if (emptyA && emptyB) {
                    return 0;
                }
                int sign = ascending ? 1 : -1;
                if (emptyA) {
                    return (b instanceof MinKey) ? sign : -sign;
                }
                return (a instanceof MinKey) ? -sign : sign;
            }
            return compareValues(keyA, keyB, true);
        }
        return compareValues(a, b, true);
    }

    /** The element an array sorts by: its smallest ascending, its largest descending. */
    private Object sortKey(Collection<?> values) {
        Object best = null;
        boolean first = true;
        for (Object value : values) {
            if (first) {
                best = value;
                first = false;
                continue;
            }
            int cmp = compareValues(value, best, true);
            if (ascending ? cmp < 0 : cmp > 0) {
                best = value;
            }
        }
        return best;
    }

    /**
     * The BSON order of two values. {@code missingIsNull}: sort and query semantics (a missing field
     * equals null); otherwise missing ranks below null.
     */
    static int compareValues(Object a, Object b, boolean missingIsNull) {
        if (a == b) {
            return 0;
        }
        int ra = rank(a, missingIsNull);
        int rb = rank(b, missingIsNull);
        if (ra != rb) {
            return Integer.compare(ra, rb);
        }
        if (a == null || a instanceof Missing || b == null || b instanceof Missing) {
            return 0;
        }
        if (a instanceof Number na && b instanceof Number nb) {
            return compareNumbers(na, nb);
        }
        if (a instanceof String sa && b instanceof String sb) {
            // String values (not field names) compare under the command's collation, if any.
            return mongotx.testserver.Collation.compare(sa, sb, ValueComparator::compareStrings);
        }
        if (a instanceof Document da && b instanceof Document db) {
            return compareDocuments(da, db, missingIsNull);
        }
        if (a instanceof Collection<?> la && b instanceof Collection<?> lb) {
            return compareArrays(la, lb, missingIsNull);
        }
        if (a instanceof ObjectId oa && b instanceof ObjectId ob) {
            return oa.compareTo(ob);
        }
        if (a instanceof Boolean ba && b instanceof Boolean bb) {
            return Boolean.compare(ba, bb);
        }
        if (a instanceof Instant ia && b instanceof Instant ib) {
            return ia.compareTo(ib);
        }
        if (a instanceof BsonTimestamp ta && b instanceof BsonTimestamp tb) {
            return ta.compareTo(tb);
        }
        if (a instanceof BsonRegularExpression xa && b instanceof BsonRegularExpression xb) {
            int cmp = compareStrings(xa.getPattern(), xb.getPattern());
            return cmp != 0 ? cmp : compareStrings(String.valueOf(xa.getOptions()), String.valueOf(xb.getOptions()));
        }
        if (a instanceof BsonJavaScript ja && b instanceof BsonJavaScript jb) {
            return compareStrings(ja.getCode(), jb.getCode());
        }
        if (a instanceof BinData da && b instanceof BinData db) {
            return da.compareTo(db);
        }
        if (a instanceof UUID ua && b instanceof UUID ub) {
            return ua.toString().compareTo(ub.toString());
        }
        if (a instanceof LegacyUUID ua && b instanceof LegacyUUID ub) {
            return ua.compareTo(ub);
        }
        // Two binary values of different Java representations (BinData, UUID): by class name, for a
        // stable total order.
        return a.getClass().getName().compareTo(b.getClass().getName());
    }

    /**
     * The rank of a value's type in MongoDB's comparison order. Missing is 1 (below null at 2) in
     * expression semantics and 2 in sort semantics.
     */
    private static int rank(Object value, boolean missingIsNull) {
        if (value instanceof MinKey) {
            return 0;
        }
        if (value instanceof Missing) {
            return missingIsNull ? 2 : 1;
        }
        if (value == null) {
            return 2;
        }
        if (value instanceof Number) {
            return 3;
        }
        if (value instanceof String) {
            return 4;
        }
        if (value instanceof Document || value instanceof Map) {
            return 5;
        }
        if (value instanceof Collection) {
            return 6;
        }
        if (value instanceof BinData || value instanceof UUID || value instanceof LegacyUUID) {
            return 7;
        }
        if (value instanceof ObjectId) {
            return 8;
        }
        if (value instanceof Boolean) {
            return 9;
        }
        if (value instanceof Instant) {
            return 10;
        }
        if (value instanceof BsonTimestamp) {
            return 11;
        }
        if (value instanceof BsonRegularExpression) {
            return 12;
        }
        if (value instanceof BsonJavaScript) {
            return 13;
        }
        if (value instanceof MaxKey) {
            return 14;
        }
        throw new UnsupportedOperationException("can't compare " + value.getClass());
    }

    /** UTF-8 byte order, which is code point order (UTF-16 code unit order differs above U+FFFF). */
    static int compareStrings(String a, String b) {
        int i = 0;
        int j = 0;
        while (i < a.length() && j < b.length()) {
            int ca = a.codePointAt(i);
            int cb = b.codePointAt(j);
            if (ca != cb) {
                return Integer.compare(ca, cb);
            }
            i += Character.charCount(ca);
            j += Character.charCount(cb);
        }
        return Boolean.compare(i < a.length(), j < b.length());
    }

    static int compareNumbers(Number a, Number b) {
        boolean nanA = isNaN(a);
        boolean nanB = isNaN(b);
        if (nanA || nanB) {
            return Boolean.compare(!nanA, !nanB);
        }
        if (integral(a) && integral(b)) {
            return Long.compare(a.longValue(), b.longValue());
        }
        if (a instanceof Decimal128 || b instanceof Decimal128) {
            return compareInfinite(a, b, () -> exact(a).compareTo(exact(b)));
        }
        double da = a.doubleValue();
        double db = b.doubleValue();
        if (integral(a)) {
            return -compareLongDouble(b.doubleValue(), a.longValue());
        }
        if (integral(b)) {
            return compareLongDouble(da, b.longValue());
        }
        // -0.0 equals 0.0 in MongoDB.
        return da == db ? 0 : Double.compare(da, db);
    }

    /** Compares a double with a long exactly, even where the long does not fit a double. */
    private static int compareLongDouble(double d, long l) {
        if (Double.isInfinite(d)) {
            return d > 0 ? 1 : -1;
        }
        return new BigDecimal(d).compareTo(BigDecimal.valueOf(l));
    }

    private interface Exact {
        int get();
    }

    private static int compareInfinite(Number a, Number b, Exact finite) {
        int ia = infinity(a);
        int ib = infinity(b);
        if (ia != 0 || ib != 0) {
            return Integer.compare(ia, ib);
        }
        return finite.get();
    }

    /**
     * The combination field of a decimal128 (the five bits after the sign): 0b11110 is an infinity
     * and 0b11111 a NaN whatever the other bits hold (IEEE 754-2008, as MongoDB reads it), so an
     * infinity or NaN with a payload is one too, not only the canonical constants.
     */
    private static int combination(Decimal128 d) {
        return (int) ((d.getHigh() >>> 58) & 0x1F);
    }

    private static int infinity(Number n) {
        if (n instanceof Decimal128 d) {
            if (combination(d) != 0x1E) {
                return 0;
            }
            return d.getHigh() < 0 ? -1 : 1;
        }
        if (n instanceof Double || n instanceof Float) {
            double v = n.doubleValue();
            return Double.isInfinite(v) ? (v > 0 ? 1 : -1) : 0;
        }
        return 0;
    }

    private static BigDecimal exact(Number n) {
        if (n instanceof Decimal128 d) {
            return d.toBigDecimal();
        }
        if (integral(n)) {
            return BigDecimal.valueOf(n.longValue());
        }
        return new BigDecimal(n.doubleValue());
    }

    private static boolean isNaN(Number n) {
        if (n instanceof Double || n instanceof Float) {
            return Double.isNaN(n.doubleValue());
        }
        return n instanceof Decimal128 d && combination(d) == 0x1F;
    }

    private static boolean integral(Number n) {
        return n instanceof Integer || n instanceof Long || n instanceof Short || n instanceof Byte;
    }

    private static int compareDocuments(Document a, Document b, boolean missingIsNull) {
        Iterator<Map.Entry<String, Object>> ia = a.entrySet().iterator();
        Iterator<Map.Entry<String, Object>> ib = b.entrySet().iterator();
        while (ia.hasNext() && ib.hasNext()) {
            Map.Entry<String, Object> ea = ia.next();
            Map.Entry<String, Object> eb = ib.next();
            int cmp = Integer.compare(rank(ea.getValue(), missingIsNull), rank(eb.getValue(), missingIsNull));
            if (cmp != 0) {
                return cmp;
            }
            cmp = compareStrings(ea.getKey(), eb.getKey());
            if (cmp != 0) {
                return cmp;
            }
            cmp = compareValues(ea.getValue(), eb.getValue(), missingIsNull);
            if (cmp != 0) {
                return cmp;
            }
        }
        return Boolean.compare(ia.hasNext(), ib.hasNext());
    }

    private static int compareArrays(Collection<?> a, Collection<?> b, boolean missingIsNull) {
        List<?> la = new ArrayList<>(a);
        List<?> lb = new ArrayList<>(b);
        for (int i = 0; i < Math.min(la.size(), lb.size()); i++) {
            int cmp = compareValues(la.get(i), lb.get(i), missingIsNull);
            if (cmp != 0) {
                return cmp;
            }
        }
        return Integer.compare(la.size(), lb.size());
    }
}
