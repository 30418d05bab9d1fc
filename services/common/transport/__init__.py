"""How the roles talk: the JetStream bus and its stage loop, the message schema, weight sync over gRPC, the object
store (checkpoints and claim checks), NATS connection, auth and the embedded server, live config and presence."""
