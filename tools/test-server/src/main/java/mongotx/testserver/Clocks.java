package mongotx.testserver;

import java.time.Duration;
import java.time.Instant;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The server's clocks: one per collection when offsets are given, so that one server can play a
 * sharded cluster whose shards' clocks disagree ({@code --clock-offset accounts=+20s,txns=-15s}).
 * A collection's clock gives {@code $$NOW} and {@code $currentDate} for every statement on that
 * collection; the clock named {@code *} (default: no offset) gives {@code hello.localTime} (as a
 * mongos would answer) and every collection without an offset of its own. Readings are whole
 * milliseconds, as a BSON date holds them.
 */
final class Clocks {

    private static final Pattern ENTRY = Pattern.compile("([^=,]+)=([+-]?)(\\d+)(ms|s|m|h)");

    private final Map<String, Duration> offsets;
    private final Duration fallback;

    private Clocks(Map<String, Duration> offsets, Duration fallback) {
        this.offsets = offsets;
        this.fallback = fallback;
    }

    /** No offsets: every clock is the machine's. */
    static Clocks none() {
        return new Clocks(Map.of(), Duration.ZERO);
    }

    /**
     * Parses {@code name=±<n><unit>,...} with units ms, s, m and h; {@code *} names the default.
     *
     * @throws IllegalArgumentException naming the entry that does not parse
     */
    static Clocks parse(String spec) {
        Map<String, Duration> offsets = new LinkedHashMap<>();
        Duration fallback = Duration.ZERO;
        for (String entry : spec.split(",")) {
            String trimmed = entry.trim();
            if (trimmed.isEmpty()) {
                continue;
            }
            Matcher m = ENTRY.matcher(trimmed);
            if (!m.matches()) {
                throw new IllegalArgumentException("clock offset `" + trimmed
                        + "` is not <collection>=<+|-><number><ms|s|m|h> (for example accounts=+20s)");
            }
            long amount = Long.parseLong(m.group(3));
            Duration offset = switch (m.group(4)) {
                case "ms" -> Duration.ofMillis(amount);
                case "s" -> Duration.ofSeconds(amount);
                case "m" -> Duration.ofMinutes(amount);
                default -> Duration.ofHours(amount);
            };
            if (m.group(2).equals("-")) {
                offset = offset.negated();
            }
            String name = m.group(1).trim();
            if (name.equals("*")) {
                fallback = offset;
            } else {
                offsets.put(name, offset);
            }
        }
        return new Clocks(offsets, fallback);
    }

    /** The time on the clock of {@code collection}'s shard. */
    Instant now(String collection) {
        return read(offsets.getOrDefault(collection, fallback));
    }

    /** The time a mongos (or a replica set's primary) reports in {@code hello}. */
    Instant serverTime() {
        return read(fallback);
    }

    private static Instant read(Duration offset) {
        return Instant.ofEpochMilli(System.currentTimeMillis()).plus(offset);
    }

    @Override
    public String toString() {
        StringBuilder text = new StringBuilder();
        offsets.forEach((name, offset) -> text.append(name).append('=').append(offset).append(' '));
        return text.append("*=").append(fallback).toString();
    }
}
