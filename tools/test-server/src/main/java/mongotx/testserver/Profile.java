package mongotx.testserver;

import java.util.List;

/**
 * The MongoDB version the server plays, and the behaviours that changed between the two it can
 * play: 8.0 (the default) and 4.4 ({@code --no-bulk-write}).
 *
 * <ul>
 * <li>{@code bulkWrite} exists from 8.0.
 * <li>A document that fails validation is explained in {@code errInfo.details} from 5.0; 4.4 says
 * only "Document failed validation".
 * <li>{@code let} on {@code find}, {@code aggregate}, {@code update}, {@code delete} and
 * {@code findAndModify} exists from 5.0.
 * <li>An update operator with an empty operand ({@code {$set: {}}}) is accepted from 5.0.
 * </ul>
 */
record Profile(List<Integer> version, int wireVersion) {

    static final Profile MONGODB_8_0 = new Profile(List.of(8, 0, 0), 25);
    static final Profile MONGODB_4_4 = new Profile(List.of(4, 4, 0), 9);

    private boolean atLeast(int major) {
        return version.get(0) >= major;
    }

    boolean runsBulkWrite() {
        return atLeast(8);
    }

    boolean explainsValidation() {
        return atLeast(5);
    }

    boolean acceptsLet() {
        return atLeast(5);
    }

    boolean acceptsEmptyOperands() {
        return atLeast(5);
    }
}
