#!/bin/sh
# Renders deploy/'s manifests with a cluster's values and prints them, as one YAML stream,
# for `kubectl apply -f -`. POSIX sh and sed only: no Helm or kustomize needed.
#
#   deploy/render.sh --api-server=HOST:PORT [--image=IMAGE] [--cluster-cidr=CIDR[,CIDR]]
#                    [--mode=ebpf|auto|iptables|ipvs] [--ports=side-by-side|kube-proxy]
#                    [--monitoring] | kubectl apply -f -
#   deploy/render.sh --uninstall [--image=IMAGE] [--pause-image=IMAGE] | kubectl apply -f -
#
# --api-server    the API server's own endpoint (not the `kubernetes` Service, which vipr
#                 itself serves): becomes KUBERNETES_SERVICE_HOST/PORT of the pod.
# --image         default vipr:0.1.0.
# --cluster-cidr  the pods' CIDR(s), kube-proxy's clusterCIDR; default empty.
# --mode          --proxy-mode; default ebpf. eBPF mode runs with a capability list, the
#                 others privileged (they write sysctls).
# --ports         side-by-side (default): health on :10266 and metrics on :10269, free while
#                 kube-proxy holds 10256 and 10249; kube-proxy: kube-proxy's own 10256 and
#                 10249, once kube-proxy is gone (cloud load balancers probe :10256/healthz).
# --monitoring    also print the PodMonitor and PrometheusRule (monitoring.yaml; needs the
#                 Prometheus operator's CRDs).
# --uninstall     print only the DaemonSet that removes vipr's datapath from every node
#                 (uninstall.yaml: `vipr --cleanup`); no --api-server needed.
# --pause-image   the uninstall DaemonSet's idle container; default registry.k8s.io/pause:3.10.
# docs/deploy.md explains each value and the two phases.
set -eu

dir=$(dirname "$0")
image=vipr:0.1.0
api_server=
cluster_cidr=
mode=ebpf
ports=side-by-side
monitoring=no
uninstall=no
pause_image=registry.k8s.io/pause:3.10

fail() {
	echo "render.sh: $*" >&2
	exit 2
}

for arg in "$@"; do
	case $arg in
	--image=*) image=${arg#*=} ;;
	--api-server=*) api_server=${arg#*=} ;;
	--cluster-cidr=*) cluster_cidr=${arg#*=} ;;
	--mode=*) mode=${arg#*=} ;;
	--ports=*) ports=${arg#*=} ;;
	--monitoring) monitoring=yes ;;
	--uninstall) uninstall=yes ;;
	--pause-image=*) pause_image=${arg#*=} ;;
	*) fail "unknown argument $arg (see the comment at the top of $0)" ;;
	esac
done

# Values land inside YAML scalars and sed replacements: only characters that cannot break
# either are accepted.
case $image in
'' | *[!A-Za-z0-9./:@_-]*) fail "--image=$image: not an image reference" ;;
esac
case $pause_image in
'' | *[!A-Za-z0-9./:@_-]*) fail "--pause-image=$pause_image: not an image reference" ;;
esac
if [ "$uninstall" = yes ]; then
	echo "---"
	echo "# Source: deploy/uninstall.yaml"
	sed -e "s|\${VIPR_IMAGE}|$image|g" -e "s|\${VIPR_PAUSE_IMAGE}|$pause_image|g" "$dir/uninstall.yaml"
	exit 0
fi
case $cluster_cidr in
*[!0-9A-Fa-f.:/,]*) fail "--cluster-cidr=$cluster_cidr: not a list of CIDRs" ;;
esac
# eBPF mode needs a few capabilities; the others write sysctls, which takes a privileged
# container (daemonset.yaml says why).
case $mode in
ebpf) privileged=false bpffs_propagation=HostToContainer ;;
auto | iptables | ipvs) privileged=true bpffs_propagation=Bidirectional ;;
*) fail "--mode=$mode: one of ebpf, auto, iptables, ipvs" ;;
esac
case $ports in
side-by-side) healthz_port=10266 metrics_port=10269 ;;
kube-proxy) healthz_port=10256 metrics_port=10249 ;;
*) fail "--ports=$ports: side-by-side or kube-proxy" ;;
esac
# HOST:PORT, HOST an IPv4 address, a DNS name or a bracketed IPv6 address.
api_port=${api_server##*:}
api_host=${api_server%:*}
case $api_host in
\[*\]) api_host=${api_host#[}; api_host=${api_host%]} ;;
esac
case $api_server in
'') fail "--api-server=HOST:PORT is required: the API server's own endpoint" ;;
esac
case $api_port in
'' | *[!0-9]*) fail "--api-server=$api_server: HOST:PORT" ;;
esac
case $api_host in
'' | *[!A-Za-z0-9.:-]*) fail "--api-server=$api_server: HOST:PORT" ;;
esac

files="rbac.yaml configmap.yaml daemonset.yaml"
if [ "$monitoring" = yes ]; then
	files="$files monitoring.yaml"
fi
for file in $files; do
	echo "---"
	echo "# Source: deploy/$file"
	sed -e "s|\${VIPR_IMAGE}|$image|g" \
		-e "s|\${VIPR_API_SERVER_HOST}|$api_host|g" \
		-e "s|\${VIPR_API_SERVER_PORT}|$api_port|g" \
		-e "s|\${VIPR_CLUSTER_CIDR}|$cluster_cidr|g" \
		-e "s|\${VIPR_MODE}|$mode|g" \
		-e "s|\${VIPR_PRIVILEGED}|$privileged|g" \
		-e "s|\${VIPR_BPFFS_PROPAGATION}|$bpffs_propagation|g" \
		-e "s|\${VIPR_HEALTHZ_PORT}|$healthz_port|g" \
		-e "s|\${VIPR_METRICS_PORT}|$metrics_port|g" \
		"$dir/$file"
done
