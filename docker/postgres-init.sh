#!/bin/sh
# Run once by the postgres image on its first start (/docker-entrypoint-initdb.d/), as
# the bootstrap superuser, in the job database. celery-lease never connects as that
# superuser; it runs as two roles:
#
#   celery_lease_owner  owns the database and its schema: `lease migrate` (the migrate
#                       service) creates and alters the tables as this role;
#   celery_lease_app    everything else (worker, beat, Flower, the API): read and write
#                       rows of the tables the owner creates, nothing more (no DDL, no
#                       other database, no superuser).
#
# tests/e2e/test_docker.py runs this script against a real PostgreSQL.
set -eu
: "${CELERY_LEASE_OWNER_PASSWORD:?set CELERY_LEASE_OWNER_PASSWORD}"
: "${CELERY_LEASE_APP_PASSWORD:?set CELERY_LEASE_APP_PASSWORD}"

psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v db="$POSTGRES_DB" \
  -v owner_password="$CELERY_LEASE_OWNER_PASSWORD" \
  -v app_password="$CELERY_LEASE_APP_PASSWORD" <<'SQL'
CREATE ROLE celery_lease_owner LOGIN PASSWORD :'owner_password';
CREATE ROLE celery_lease_app LOGIN PASSWORD :'app_password';
ALTER DATABASE :"db" OWNER TO celery_lease_owner;
REVOKE ALL ON DATABASE :"db" FROM PUBLIC;
GRANT CONNECT ON DATABASE :"db" TO celery_lease_app;
ALTER SCHEMA public OWNER TO celery_lease_owner;
REVOKE ALL ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO celery_lease_app;
-- Whatever the owner creates later (every migration's tables and sequences).
ALTER DEFAULT PRIVILEGES FOR ROLE celery_lease_owner IN SCHEMA public
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO celery_lease_app;
ALTER DEFAULT PRIVILEGES FOR ROLE celery_lease_owner IN SCHEMA public
  GRANT USAGE, SELECT ON SEQUENCES TO celery_lease_app;
SQL
