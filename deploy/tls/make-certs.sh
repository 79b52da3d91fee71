#!/usr/bin/env bash
# Certificates and tokens for specinfer with TLS (docker-compose.tls.yml, deploy/k8s/overlays/tls):
# a private CA, one certificate per service, the internal token and the public API token.
#
#   deploy/tls/make-certs.sh [-o DIR] [-n NAMESPACE] [-d DAYS] [NAME ...]
#
#   DIR        where the files go (default: deploy/tls/secrets); must not exist yet or be empty
#   NAMESPACE  Kubernetes namespace the certificates' cluster names are in (default: specinfer)
#   DAYS       validity of the service certificates (default: 365; the CA: 10 years)
#   NAME       further DNS names or IP addresses of the request manager: how clients outside reach
#              the public API (e.g. api.example.com, 203.0.113.7)
#
# Needs openssl (1.1.1 or newer, or LibreSSL). Writes, in DIR:
#   ca.crt, ca.key                       the CA (keep ca.key elsewhere once done: nothing mounts it)
#   <service>.crt, <service>.key         request-manager, ssm-worker, llm-verifier
#   internal-token, auth-token           random tokens (calls between services; the public API key)
#
# Each service certificate names its service as Compose and Kubernetes address it (ssm-worker,
# ssm-worker.NAMESPACE.svc, ...) plus localhost and 127.0.0.1, which the health check in the same
# container dials; it is valid for server and client authentication, so one certificate per
# service serves its port and identifies it to mTLS ports (the request manager calling the others,
# each health check calling its own port).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out="$here/secrets"
namespace=specinfer
days=365
usage() { sed -n '5,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while getopts "o:n:d:h" opt; do
  case $opt in
    o) out=$OPTARG ;;
    n) namespace=$OPTARG ;;
    d) days=$OPTARG ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
extra=("$@")

command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found" >&2; exit 1; }
if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "make-certs.sh: $out is not empty; give another -o DIR (or remove it) to make new ones" >&2
  exit 1
fi
mkdir -p "$out"
# The folder keeps other users of this machine out. The files in it are world-readable on purpose:
# Compose bind-mounts them into containers that run as uid 10001, keeping the host's owner and mode
# (file secrets ignore uid/gid/mode), so a 0600 file owned by you could not be read there.
chmod 700 "$out"
umask 022
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

cat >"$work/ca.cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = specinfer CA
[ca]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
CNF
key "$out/ca.key"
chmod 600 "$out/ca.key"
openssl req -x509 -new -key "$out/ca.key" -config "$work/ca.cnf" -extensions ca -days 3650 -sha256 -out "$out/ca.crt"

# service_cert NAME [MORE_NAMES...]: NAME.crt/NAME.key signed by the CA
service_cert() {
  local name=$1
  shift
  local sans=() host
  for host in "$name" "$@"; do
    sans+=("DNS:$host" "DNS:$host.$namespace" "DNS:$host.$namespace.svc" "DNS:$host.$namespace.svc.cluster.local")
  done
  sans+=("DNS:localhost" "IP:127.0.0.1")
  if [ "$name" = request-manager ]; then
    for host in "${extra[@]+"${extra[@]}"}"; do
      if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then sans+=("IP:$host"); else sans+=("DNS:$host"); fi
    done
  fi
  local san
  san=$(IFS=,; echo "${sans[*]}")
  cat >"$work/$name.ext" <<EXT
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = $san
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
EXT
  key "$out/$name.key"
  openssl req -new -key "$out/$name.key" -subj "/CN=$name" -out "$work/$name.csr"
  openssl x509 -req -in "$work/$name.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
    -days "$days" -sha256 -extfile "$work/$name.ext" -out "$out/$name.crt" 2>/dev/null
  chmod 644 "$out/$name.key" # openssl writes keys 0600; see the chmod 700 above for why not here
}

service_cert request-manager request-manager-public
service_cert ssm-worker
service_cert llm-verifier
openssl rand -hex 32 >"$out/internal-token"
openssl rand -hex 32 >"$out/auth-token"

echo "wrote $out: ca.crt, ca.key, {request-manager,ssm-worker,llm-verifier}.{crt,key}, internal-token, auth-token"
