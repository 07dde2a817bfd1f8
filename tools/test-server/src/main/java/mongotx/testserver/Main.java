package mongotx.testserver;

import java.io.IOException;
import java.io.InputStream;
import java.net.InetSocketAddress;
import java.util.ArrayList;
import java.util.List;

import de.bwaldvogel.mongo.MongoServer;
import de.bwaldvogel.mongo.MongoVersion;

/**
 * Starts the mongotx test server: mongo-java-server (in-memory backend) made to follow MongoDB
 * where mongotx depends on it ({@link AtomicBackend}), on a loopback port.
 *
 * <p>Usage: {@code java -jar mongotx-test-server.jar [--host 127.0.0.1] [--port 0] [--no-bulk-write]
 * [--clock-offset <collection>=<±n><ms|s|m|h>,...] [--no-prefilter]
 * [--user NAME:PASSWORD:ROLE@DB[+ROLE@DB...]]...}. Port 0 picks a free port. The server plays
 * MongoDB 8.0 (wire version 25); {@code --no-bulk-write} makes it play 4.4 (wire version 9: no
 * {@code bulkWrite}, no {@code let}, validation errors without details). {@code --clock-offset}
 * gives collections clocks of their own, as the shards of a cluster whose clocks disagree
 * ({@code *} names the default, which {@code hello} reports). {@code --no-prefilter} leaves every
 * document to mongo-java-server's matcher ({@link Prefilter}), to check that the answers agree.
 * {@code --user} (repeatable) defines a user on {@code admin} with built-in roles, each on its
 * database ({@code --user app:secret:readWrite@shop}, {@code --user admin:pw:root@admin},
 * {@code --user ops:pw:read@shop+dbAdmin@shop}); with at least one, clients must authenticate
 * (SCRAM-SHA-256, {@code authSource=admin}) and may run only what their roles allow, as on MongoDB
 * ({@link Security}); without any, nothing is checked. Once listening it prints one line
 * {@code MONGOTX_TEST_SERVER_PORT=<port>} to stdout. It shuts down when stdin reaches end-of-file,
 * so a parent process that dies (or simply closes the pipe) never leaves a server behind, and also
 * on SIGINT/SIGTERM.
 */
public final class Main {

    private Main() {
    }

    /**
     * The Rust driver 3.x refuses servers whose maximum wire version is below 9 (MongoDB 4.4), while
     * mongo-java-server's newest built-in version reports 8; the driver sends {@code bulkWrite} only
     * to wire version 25 (8.0) and up.
     */
    private static MongoVersion announced(Profile profile) {
        return new MongoVersion() {
            @Override
            public java.util.List<Integer> getVersionArray() {
                return profile.version();
            }

            @Override
            public int getWireVersion() {
                return profile.wireVersion();
            }
        };
    }

    public static void main(String[] args) throws IOException {
        String host = "127.0.0.1";
        int port = 0;
        Profile profile = Profile.MONGODB_8_0;
        Clocks clocks = Clocks.none();
        boolean prefilter = true;
        List<String> userSpecs = new ArrayList<>();
        for (int i = 0; i < args.length; i++) {
            switch (args[i]) {
                case "--host" -> host = args[++i];
                case "--port" -> port = Integer.parseInt(args[++i]);
                case "--no-bulk-write" -> profile = Profile.MONGODB_4_4;
                case "--no-prefilter" -> prefilter = false;
                case "--user" -> userSpecs.add(args[++i]);
                case "--clock-offset" -> {
                    try {
                        clocks = Clocks.parse(args[++i]);
                    } catch (IllegalArgumentException e) {
                        System.err.println(e.getMessage());
                        System.exit(2);
                    }
                }
                default -> {
                    System.err.println("unknown argument: " + args[i]);
                    System.exit(2);
                }
            }
        }

        Security security = null;
        if (!userSpecs.isEmpty()) {
            try {
                security = new Security(Users.parse(userSpecs));
            } catch (IllegalArgumentException e) {
                System.err.println(e.getMessage());
                System.exit(2);
            }
        }

        AtomicBackend backend = new AtomicBackend(profile, clocks, prefilter, security);
        backend.version(announced(profile));
        MongoServer server = new MongoServer(backend);
        server.bind(host, port);
        InetSocketAddress address = server.getLocalAddress();
        Runtime.getRuntime().addShutdownHook(new Thread(server::shutdownNow));
        System.out.println("MONGOTX_TEST_SERVER_PORT=" + address.getPort());
        System.out.flush();

        InputStream in = System.in;
        byte[] buffer = new byte[256];
        while (in.read(buffer) >= 0) {
            // Input is ignored; only end-of-file matters.
        }
        server.shutdownNow();
        System.exit(0);
    }
}
