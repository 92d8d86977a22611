#!/bin/sh
# The read-only role that rldiag's dashboard and watcher log in with (docker-compose.yml mounts this
# into the postgres image's /docker-entrypoint-initdb.d/, which runs it once, on the first start of an
# empty data volume). To add it to an existing deployment, run it once by hand:
#   docker compose exec postgres sh /docker-entrypoint-initdb.d/10-rldiag-readonly.sh
#
# The role may read every table the MLflow server's role (POSTGRES_USER) has created or will create
# (default privileges: MLflow's migrations add tables later), and nothing else: no INSERT, UPDATE,
# DELETE, DDL or new objects; its sessions are READ ONLY by default as well.
set -eu
: "${RLDIAG_DB_USER:=rldiag_reader}"
: "${RLDIAG_DB_PASSWORD:?set RLDIAG_DB_PASSWORD, the read-only role's password}"

psql -v ON_ERROR_STOP=1 --no-psqlrc --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
     -v ro="$RLDIAG_DB_USER" -v ro_password="$RLDIAG_DB_PASSWORD" -v owner="$POSTGRES_USER" -v db="$POSTGRES_DB" <<'SQL'
SELECT NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'ro') AS create_role \gset
\if :create_role
  CREATE ROLE :"ro" LOGIN PASSWORD :'ro_password' NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION;
\else
  ALTER ROLE :"ro" LOGIN PASSWORD :'ro_password' NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION;
\endif
ALTER ROLE :"ro" SET default_transaction_read_only = on;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT CONNECT ON DATABASE :"db" TO :"ro";
GRANT USAGE ON SCHEMA public TO :"ro";
GRANT SELECT ON ALL TABLES IN SCHEMA public TO :"ro";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public GRANT SELECT ON TABLES TO :"ro";
SQL
