#!/bin/sh
# Run by the one-shot minio/mc service of docker-compose.yml: wait for MinIO, create $BUCKET.
set -eu
: "${MINIO_ENDPOINT:=http://minio:9000}"
: "${MINIO_ROOT_USER:=minioadmin}"
: "${MINIO_ROOT_PASSWORD:=minioadmin}"
: "${BUCKET:=ckptstore-test}"

i=0
until mc alias set local "$MINIO_ENDPOINT" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null 2>&1 \
    && mc ls local >/dev/null 2>&1; do
  i=$((i + 1))
  if [ "$i" -ge 60 ]; then
    echo "MinIO at $MINIO_ENDPOINT not reachable after 60 s" >&2
    exit 1
  fi
  sleep 1
done
mc mb --ignore-existing "local/$BUCKET"
echo "bucket $BUCKET ready"
