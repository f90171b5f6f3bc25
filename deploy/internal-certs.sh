#!/usr/bin/env bash
# A private CA and one certificate per splitserve service, for the internal mTLS that deploy/ turns on.
#
#   bash deploy/internal-certs.sh DIR NAME[:SAN,SAN...]...
#   e.g. compose:     bash deploy/internal-certs.sh deploy/pki gateway prefill decode-0 decode-1
#        Kubernetes:  one certificate per role, naming the role's pods through a wildcard on its pool's
#                     headless Service (then one Secret per role: docs/deploy.md, "Internal mTLS"):
#                     bash deploy/internal-certs.sh pki gateway \
#                       'prefill:*.splitserve-prefill.llm.svc.cluster.local' \
#                       'decode:*.splitserve-decode.llm.svc.cluster.local'
#        pools, short: POOL_NAMESPACE=llm bash deploy/internal-certs.sh pki gateway splitserve-prefill \
#                       splitserve-decode   (each NAME a pool's headless Service in namespace llm)
#
# Writes DIR/ca.pem and DIR/ca.key (the CA; an existing one in DIR is reused, so a service added
# later gets a certificate of the same CA), and DIR/NAME.pem + DIR/NAME.key for each NAME: an EC P-256
# key and a certificate signed by the CA for server and client use, whose subjectAltNames are NAME, the SANs
# listed after it (DNS names; a leading "*." covers one label, e.g. every pod of a StatefulSet) and SERVER_NAME.
# With POOL_NAMESPACE, NAME is a pool's headless Service and its certificate also names NAME.NS, NAME.NS.svc,
# NAME.NS.svc.CLUSTER_DOMAIN and *.NAME.NS.svc.CLUSTER_DOMAIN: the name the gateway checks a member it found
# through --prefill/--decode dns:///NAME...:PORT against (it dials the pod's IP) when
# --internal-tls-server-name is empty, and the pods' own names.
# Every splitserve process checks its peers' certificates against SERVER_NAME
# (--internal-tls-server-name): peers dial each other by advertised addresses (pod IPs in Kubernetes),
# which no certificate can list in advance, so what a server proves is that it holds a certificate of
# this CA. Keep ca.key away from the services (they need ca.pem only).
#
# Environment: SERVER_NAME (default splitserve-internal), POOL_NAMESPACE (off by default), CLUSTER_DOMAIN
# (default cluster.local), DAYS (validity, default 365), OWNER (uid:gid to chown the keys to, e.g.
# 10001:10001, the containers' user, for a compose bind mount; needs root), KEY_MODE (default 0600).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 DIR NAME[:SAN,SAN...]... (e.g. $0 deploy/pki gateway prefill decode-0 decode-1)" >&2
  exit 2
fi
dir=$1
shift
server_name=${SERVER_NAME:-splitserve-internal}
days=${DAYS:-365}
command -v openssl >/dev/null || { echo "$0: openssl is needed" >&2; exit 1; }
mkdir -p "$dir"
umask 077

if [ ! -f "$dir/ca.pem" ] || [ ! -f "$dir/ca.key" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
    -keyout "$dir/ca.key" -out "$dir/ca.pem" -subj "/CN=splitserve internal CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
  echo "CA: $dir/ca.pem"
fi

dns_name() {  # a DNS name, or "*." and one: exits naming the bad one
  case "${1#\*.}" in
    *[!A-Za-z0-9.-]* | "") echo "$0: '$1' is not a DNS name (letters, digits, '.', '-'; a leading '*.')" >&2; exit 2 ;;
  esac
}

for arg in "$@"; do
  name=${arg%%:*}
  case "$name" in
    *[!A-Za-z0-9.-]* | "") echo "$0: '$name' is not a DNS name (letters, digits, '.', '-')" >&2; exit 2 ;;
  esac
  sans="DNS:$name"
  if [ -n "${POOL_NAMESPACE:-}" ]; then
    dns_name "$POOL_NAMESPACE"
    pool="$name.$POOL_NAMESPACE.svc"
    fqdn="$pool.${CLUSTER_DOMAIN:-cluster.local}"
    sans="$sans,DNS:$name.$POOL_NAMESPACE,DNS:$pool,DNS:$fqdn,DNS:*.$fqdn"
  fi
  if [ "$arg" != "$name" ]; then
    IFS=, read -r -a extra <<<"${arg#*:}"
    for san in "${extra[@]}"; do dns_name "$san"; sans="$sans,DNS:$san"; done
  fi
  sans="$sans,DNS:$server_name"
  ext=$(mktemp)
  printf '%s\n' "subjectAltName=$sans" "extendedKeyUsage=serverAuth,clientAuth" \
    "keyUsage=critical,digitalSignature" "basicConstraints=critical,CA:FALSE" >"$ext"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$dir/$name.key" \
    -out "$dir/$name.csr" -subj "/CN=$name" 2>/dev/null
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" -CAcreateserial \
    -days "$days" -extfile "$ext" -out "$dir/$name.pem" 2>/dev/null
  rm -f "$ext" "$dir/$name.csr"
  chmod 0644 "$dir/$name.pem"
  chmod "${KEY_MODE:-0600}" "$dir/$name.key"
  if [ -n "${OWNER:-}" ]; then chown "$OWNER" "$dir/$name.key" "$dir/$name.pem"; fi
  echo "$name: $dir/$name.pem, $dir/$name.key (${sans//,/, })"
done
chmod 0644 "$dir/ca.pem"
