"""The job database: schema, the SQL catalogue, engines, the store, migrations, and its
driver made cooperative in gevent/eventlet workers (:mod:`.green`)."""
