package mongotx.testserver;

import java.io.IOException;
import java.io.InputStream;
import java.net.InetSocketAddress;
import java.util.List;

import de.bwaldvogel.mongo.MongoServer;
import de.bwaldvogel.mongo.MongoVersion;

/**
 * Starts mongo-java-server (in-memory backend, made atomic for readers by {@link AtomicBackend}) on a
 * loopback port for the mongotx test suite.
 *
 * <p>Usage: {@code java -jar mongotx-test-server.jar [--host 127.0.0.1] [--port 0] [--no-bulk-write]}.
 * Port 0 picks a free port. {@code --no-bulk-write} makes it a server older than MongoDB 8.0: it
 * announces 4.4 and refuses {@code bulkWrite}. Once listening it prints one line {@code MONGOTX_TEST_SERVER_PORT=<port>} to stdout.
 * It shuts down when stdin reaches end-of-file, so a parent process that dies (or simply closes
 * the pipe) never leaves a server behind, and also on SIGINT/SIGTERM.
 */
public final class Main {

    /**
     * The Rust driver 3.x refuses servers whose maximum wire version is below 9 (MongoDB 4.4),
     * while mongo-java-server's newest built-in version reports 8. The server implements the
     * OP_MSG commands the driver uses, so it announces 4.4 / wire 9, or, since the wrapper runs
     * {@code bulkWrite} (the one 8.0 command the driver gates on the wire version), 8.0 / wire 25.
     */
    private static MongoVersion announced(List<Integer> version, int wire) {
        return new MongoVersion() {
            @Override
            public List<Integer> getVersionArray() {
                return version;
            }

            @Override
            public int getWireVersion() {
                return wire;
            }
        };
    }

    private Main() {
    }

    public static void main(String[] args) throws IOException {
        String host = "127.0.0.1";
        int port = 0;
        boolean bulkWrites = true;
        for (int i = 0; i < args.length; i++) {
            switch (args[i]) {
                case "--host" -> host = args[++i];
                case "--port" -> port = Integer.parseInt(args[++i]);
                case "--no-bulk-write" -> bulkWrites = false;
                default -> {
                    System.err.println("unknown argument: " + args[i]);
                    System.exit(2);
                }
            }
        }

        AtomicBackend backend = new AtomicBackend(bulkWrites);
        backend.version(bulkWrites ? announced(List.of(8, 0, 0), 25) : announced(List.of(4, 4, 0), 9));
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
