"""The job database: schema, the SQL catalogue, engines, the store, migrations."""
