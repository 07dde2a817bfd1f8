package mongotx.testserver;

import java.nio.charset.StandardCharsets;
import java.security.GeneralSecurityException;
import java.security.MessageDigest;
import java.security.SecureRandom;
import java.util.Base64;

import javax.crypto.Mac;
import javax.crypto.SecretKeyFactory;
import javax.crypto.spec.PBEKeySpec;
import javax.crypto.spec.SecretKeySpec;

/**
 * The server side of SCRAM-SHA-256 (RFC 5802, RFC 7677) as MongoDB runs it: the client's first
 * message ({@code n,,n=user,r=nonce}) in {@code saslStart}, the server's challenge with the salt and
 * iteration count, the client's proof in {@code saslContinue}, and the server's signature
 * ({@code v=...}) that lets the client know it spoke to a server holding its credentials.
 *
 * <p>The server keeps what MongoDB keeps for a user (the salt, the iteration count, StoredKey and
 * ServerKey), never the password, and MongoDB's defaults: 15000 iterations (drivers refuse fewer
 * than 4096), a 28-byte random salt per user, 24 random bytes of server nonce. Passwords are taken
 * as they are: SASLprep is not applied, which changes nothing for the printable ASCII passwords
 * {@link Users} accepts.
 */
final class Scram {

    static final String MECHANISM = "SCRAM-SHA-256";
    static final int ITERATIONS = 15_000;
    private static final int SALT_BYTES = 28;
    private static final int NONCE_BYTES = 24;

    private Scram() {
    }

    /** Any failure of the exchange; the client is told only "Authentication failed.". */
    static final class Failure extends Exception {
        private static final long serialVersionUID = 1L;

        Failure(String reason) {
            super(reason);
        }
    }

    /** What the server stores for a user. */
    record Credentials(byte[] salt, int iterations, byte[] storedKey, byte[] serverKey) {

        static Credentials derive(String password, SecureRandom random) {
            byte[] salt = new byte[SALT_BYTES];
            random.nextBytes(salt);
            byte[] salted = pbkdf2(password, salt, ITERATIONS);
            byte[] storedKey = sha256(hmac(salted, "Client Key"));
            byte[] serverKey = hmac(salted, "Server Key");
            return new Credentials(salt, ITERATIONS, storedKey, serverKey);
        }
    }

    /** The client's first message, parsed: enough to look the user up before the challenge. */
    record ClientFirst(String gs2Header, String bare, String user, String nonce) {

        /**
         * {@code gs2-header client-first-bare}: the header is {@code n,,} or {@code y,,} (no channel
         * binding, which MongoDB does not offer; no authorization identity), the bare part
         * {@code n=<user>,r=<nonce>} with {@code =2C} and {@code =3D} standing for {@code ,} and
         * {@code =} in the name.
         */
        static ClientFirst parse(byte[] payload) throws Failure {
            String message = new String(payload, StandardCharsets.UTF_8);
            if (!(message.startsWith("n,") || message.startsWith("y,"))) {
                throw new Failure("channel binding is not supported: " + message);
            }
            int end = message.indexOf(',', 2);
            if (end != 2) {
                throw new Failure("an authorization identity is not supported: " + message);
            }
            String bare = message.substring(end + 1);
            String[] parts = bare.split(",", -1);
            if (parts.length != 2 || !parts[0].startsWith("n=") || !parts[1].startsWith("r=")) {
                throw new Failure("client-first-message is not n=<user>,r=<nonce>: " + bare);
            }
            String nonce = parts[1].substring(2);
            if (nonce.isEmpty() || !nonce.chars().allMatch(c -> c > 0x20 && c < 0x7f && c != ',')) {
                throw new Failure("bad client nonce");
            }
            return new ClientFirst(message.substring(0, end + 1), bare, unescape(parts[0].substring(2)), nonce);
        }

        private static String unescape(String name) throws Failure {
            StringBuilder plain = new StringBuilder();
            for (int i = 0; i < name.length(); i++) {
                char c = name.charAt(i);
                if (c != '=') {
                    plain.append(c);
                } else if (name.startsWith("=2C", i)) {
                    plain.append(',');
                    i += 2;
                } else if (name.startsWith("=3D", i)) {
                    plain.append('=');
                    i += 2;
                } else {
                    throw new Failure("bad escape in user name " + name);
                }
            }
            if (plain.isEmpty()) {
                throw new Failure("empty user name");
            }
            return plain.toString();
        }
    }

    /** One exchange after the client's first message: the challenge sent, the proof awaited. */
    static final class Conversation {

        private final ClientFirst first;
        private final Credentials credentials;
        private final String nonce;
        private final String serverFirst;
        private boolean finished;

        Conversation(ClientFirst first, Credentials credentials, SecureRandom random) {
            this.first = first;
            this.credentials = credentials;
            byte[] serverNonce = new byte[NONCE_BYTES];
            random.nextBytes(serverNonce);
            this.nonce = first.nonce() + Base64.getEncoder().encodeToString(serverNonce);
            this.serverFirst = "r=" + nonce + ",s=" + Base64.getEncoder().encodeToString(credentials.salt()) + ",i="
                    + credentials.iterations();
        }

        /** {@code r=<client nonce><server nonce>,s=<salt>,i=<iterations>}. */
        byte[] serverFirst() {
            return serverFirst.getBytes(StandardCharsets.UTF_8);
        }

        /**
         * Checks {@code c=<gs2 header>,r=<nonce>,p=<proof>} and answers {@code v=<server signature>}.
         * One attempt per conversation.
         */
        byte[] finish(byte[] payload) throws Failure {
            if (finished) {
                throw new Failure("conversation already finished");
            }
            finished = true;
            String message = new String(payload, StandardCharsets.UTF_8);
            int proofAt = message.lastIndexOf(",p=");
            if (proofAt < 0) {
                throw new Failure("client-final-message without proof");
            }
            String withoutProof = message.substring(0, proofAt);
            String[] parts = withoutProof.split(",", -1);
            String binding = "c=" + Base64.getEncoder().encodeToString(first.gs2Header().getBytes(StandardCharsets.UTF_8));
            if (parts.length != 2 || !parts[0].equals(binding) || !parts[1].equals("r=" + nonce)) {
                throw new Failure("client-final-message does not match the conversation: " + withoutProof);
            }
            byte[] proof;
            try {
                proof = Base64.getDecoder().decode(message.substring(proofAt + 3));
            } catch (IllegalArgumentException e) {
                throw new Failure("proof is not base64");
            }
            String authMessage = first.bare() + "," + serverFirst + "," + withoutProof;
            byte[] clientSignature = hmac(credentials.storedKey(), authMessage);
            if (proof.length != clientSignature.length) {
                throw new Failure("proof has the wrong length");
            }
            byte[] clientKey = new byte[proof.length];
            for (int i = 0; i < proof.length; i++) {
                clientKey[i] = (byte) (proof[i] ^ clientSignature[i]);
            }
            if (!MessageDigest.isEqual(sha256(clientKey), credentials.storedKey())) {
                throw new Failure("wrong proof");
            }
            byte[] serverSignature = hmac(credentials.serverKey(), authMessage);
            return ("v=" + Base64.getEncoder().encodeToString(serverSignature)).getBytes(StandardCharsets.UTF_8);
        }
    }

    private static byte[] pbkdf2(String password, byte[] salt, int iterations) {
        try {
            SecretKeyFactory factory = SecretKeyFactory.getInstance("PBKDF2WithHmacSHA256");
            return factory.generateSecret(new PBEKeySpec(password.toCharArray(), salt, iterations, 256)).getEncoded();
        } catch (GeneralSecurityException e) {
            throw new IllegalStateException("the JDK lacks PBKDF2WithHmacSHA256", e);
        }
    }

    private static byte[] hmac(byte[] key, String text) {
        try {
            Mac mac = Mac.getInstance("HmacSHA256");
            mac.init(new SecretKeySpec(key, "HmacSHA256"));
            return mac.doFinal(text.getBytes(StandardCharsets.UTF_8));
        } catch (GeneralSecurityException e) {
            throw new IllegalStateException("the JDK lacks HmacSHA256", e);
        }
    }

    private static byte[] sha256(byte[] data) {
        try {
            return MessageDigest.getInstance("SHA-256").digest(data);
        } catch (GeneralSecurityException e) {
            throw new IllegalStateException("the JDK lacks SHA-256", e);
        }
    }
}
