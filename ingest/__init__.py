"""What agents emit and how it reaches Kafka: the event contract, wire format and SDK."""
