"""The ClickHouse store: schema migrations, clients, the sink and the store service."""
