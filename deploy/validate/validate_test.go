package validate

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// The repository root, from deploy/validate.
var root = filepath.Join("..", "..")

func k8sDir(parts ...string) string {
	return filepath.Join(append([]string{root, "deploy", "k8s"}, parts...)...)
}

// build runs kustomize (the library kubectl embeds) on a kustomization directory.
func build(t *testing.T, dir string) []byte {
	t.Helper()
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	out, err := m.AsYaml()
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	return out
}

func decodeOK(t *testing.T, source string, data []byte) []Object {
	t.Helper()
	objs, errs := DecodeAll(source, data)
	for _, e := range errs {
		t.Error(e)
	}
	if len(objs) == 0 {
		t.Fatalf("%s: no objects", source)
	}
	return objs
}

func checkOK(t *testing.T, objs []Object, want Expect) {
	t.Helper()
	for _, e := range Check(objs, want) {
		t.Error(e)
	}
	t.Logf("%d objects validated: %s", len(objs), Summary(objs))
}

// Every kustomization in deploy/k8s builds, and each built object decodes strictly and passes the checks.
func TestKustomizeVariants(t *testing.T) {
	cases := []struct {
		name string
		dir  string
		want Expect
	}{
		{"cpu", k8sDir("base"), Expect{Metrics: true}},
		{"cuda", k8sDir("overlays", "cuda"), Expect{GPU: true, Metrics: true}},
		{"monitoring", k8sDir("overlays", "monitoring"), Expect{Metrics: true, ServiceMonitor: true}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			objs := decodeOK(t, "kustomize:"+c.name, build(t, c.dir))
			checkOK(t, objs, c.want)
		})
	}
}

// Every YAML file under deploy/k8s (manifests, patches, kustomizations) decodes strictly on its own.
func TestPlainManifestsStrict(t *testing.T) {
	n := 0
	err := filepath.WalkDir(k8sDir(), func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !(strings.HasSuffix(path, ".yaml") || strings.HasSuffix(path, ".yml")) {
			return err
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		n += len(decodeOK(t, path, data))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n < 10 {
		t.Fatalf("only %d documents under deploy/k8s", n)
	}
	t.Logf("%d plain documents decoded strictly", n)
}

// The Helm chart's renderings (made by deploy/ci.sh with helm template into $FERRUM_RENDERED).
func TestHelmRendered(t *testing.T) {
	dir := os.Getenv("FERRUM_RENDERED")
	if dir == "" {
		t.Skip("FERRUM_RENDERED is not set: run deploy/ci.sh, which renders the chart with helm template")
	}
	cases := []struct {
		file string
		want Expect
	}{
		{"default.yaml", Expect{Metrics: true}},
		{"gpu.yaml", Expect{GPU: true, Metrics: true}},
		{"tls-auth-monitor.yaml", Expect{TLS: true, Metrics: true, ServiceMonitor: true, PrometheusRule: true}},
		{"no-metrics.yaml", Expect{}},
		{"roles.yaml", Expect{Metrics: true, Roles: true}},
		{"gateway.yaml", Expect{Metrics: true, Gateway: true}},
		{"hub.yaml", Expect{Metrics: true}},
		{"gateway-roles.yaml", Expect{Metrics: true, Roles: true, Gateway: true, SharedPrefix: true}},
	}
	for _, c := range cases {
		t.Run(strings.TrimSuffix(c.file, ".yaml"), func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join(dir, c.file))
			if err != nil {
				t.Fatal(err)
			}
			objs := decodeOK(t, "helm:"+c.file, data)
			checkOK(t, objs, c.want)
		})
	}
	// A rendering with a deliberately misspelt field (an extraEnv entry with "valeu") must fail.
	t.Run("broken-field-fails", func(t *testing.T) {
		data, err := os.ReadFile(filepath.Join(dir, "broken.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		_, errs := DecodeAll("helm:broken.yaml", data)
		if len(errs) == 0 {
			t.Fatal("a rendering with an unknown field decoded without error")
		}
		if !strings.Contains(errs[0].Error(), "valeu") {
			t.Fatalf("error does not name the bad field: %v", errs[0])
		}
		t.Logf("rejected as expected: %v", errs[0])
	})
}

// Deliberately broken documents: strict decoding or the semantic checks must reject each.
func TestBrokenDocumentsFail(t *testing.T) {
	base, err := os.ReadFile(k8sDir("base", "deployment.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	mutate := func(old, new string) string {
		s := string(base)
		if !strings.Contains(s, old) {
			t.Fatalf("deployment.yaml no longer contains %q", old)
		}
		return strings.Replace(s, old, new, 1)
	}
	decodeCases := map[string]string{
		"misspelt field (readOnlyRootFileSystem)": mutate("readOnlyRootFilesystem: true", "readOnlyRootFileSystem: true"),
		"unknown probe field (grpcc)":             mutate("startupProbe:\n            grpc:", "startupProbe:\n            grpcc:"),
		"wrong type (replicas: two)":              mutate("replicas: 2", "replicas: two"),
		"duplicate field":                         mutate("replicas: 2", "replicas: 2\n  replicas: 3"),
		"unknown kind":                            "apiVersion: v1\nkind: Servize\nmetadata:\n  name: x\n",
		"service with misspelt clusterIP":         "apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  clusterIp: None\n",
	}
	for name, doc := range decodeCases {
		t.Run("decode/"+name, func(t *testing.T) {
			if _, err := Decode(name, []byte(doc)); err == nil {
				t.Fatal("decoded without error")
			} else {
				t.Logf("rejected: %v", err)
			}
		})
	}

	// Semantic: start from the valid CPU build and break one property at a time.
	built := string(build(t, k8sDir("base")))
	semanticCases := []struct {
		name, old, new string
		want           Expect
		errHas         string
	}{
		{"http probe instead of grpc", "failureThreshold: 2\n          grpc:\n            port: 50051\n            service: \"\"", "failureThreshold: 2\n          httpGet:\n            port: 9090\n            path: /metrics", Expect{Metrics: true}, "native grpc probe"},
		{"probe on the wrong port", "failureThreshold: 3\n          grpc:\n            port: 50051", "failureThreshold: 3\n          grpc:\n            port: 9090", Expect{Metrics: true}, "grpc port must be"},
		{"startup too short for model load", "failureThreshold: 60", "failureThreshold: 6", Expect{Metrics: true}, "model load"},
		{"grace period shorter than the drain", "terminationGracePeriodSeconds: 35", "terminationGracePeriodSeconds: 20", Expect{Metrics: true}, "terminationGracePeriodSeconds"},
		{"root allowed", "runAsNonRoot: true\n        runAsUser: 10001", "runAsNonRoot: false\n        runAsUser: 10001", Expect{Metrics: true}, "runAsNonRoot"},
		{"writable root fs", "readOnlyRootFilesystem: true", "readOnlyRootFilesystem: false", Expect{Metrics: true}, "readOnlyRootFilesystem"},
		{"headless Service lost clusterIP None", "  clusterIP: None\n", "", Expect{Metrics: true}, "headless"},
		{"GPU variant without nvidia.com/gpu", "", "", Expect{GPU: true, Metrics: true}, "nvidia.com/gpu"},
	}
	for _, c := range semanticCases {
		t.Run("semantic/"+c.name, func(t *testing.T) {
			doc := built
			if c.old != "" {
				if !strings.Contains(doc, c.old) {
					t.Fatalf("the built base no longer contains %q", c.old)
				}
				doc = strings.Replace(doc, c.old, c.new, 1)
			}
			objs, errs := DecodeAll(c.name, []byte(doc))
			if len(errs) > 0 {
				t.Fatalf("the mutated build should still decode: %v", errs)
			}
			got := Check(objs, c.want)
			for _, e := range got {
				if strings.Contains(e.Error(), c.errHas) {
					t.Logf("rejected: %v", e)
					return
				}
			}
			t.Fatalf("no error mentioning %q; got %v", c.errHas, got)
		})
	}
}

// The gateway rendering with one thing wrong each: the semantic checks must reject it.
func TestGatewayBrokenFails(t *testing.T) {
	dir := os.Getenv("FERRUM_RENDERED")
	if dir == "" {
		t.Skip("FERRUM_RENDERED is not set: run deploy/ci.sh, which renders the chart with helm template")
	}
	good, err := os.ReadFile(filepath.Join(dir, "gateway.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	pd, err := os.ReadFile(filepath.Join(dir, "gateway-roles.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct{ name, from, to, want string }{
		{"selector misses the workers", `"app.kubernetes.io/component=model-executor"`, `"app.kubernetes.io/component=nothing"`, "does not match the pods"},
		// SMG's PD mode over the two roles (gateway-roles.yaml)
		{"pd: prefill selector finds the decode pods", `"ferrum.io/role=prefill"`, `"ferrum.io/role=decode"`, "--prefill-selector"},
		{"pd: prefill advertises no pod address", `"$(POD_IP):50051"`, `"localhost:50051"`, "must advertise"},
		{"pd: decode names no peer", "- --kv-peer\n", "- --kv-peers\n", "--kv-peer"},
		{"no watch on pods", `verbs: ["get", "list", "watch"]`, `verbs: ["get", "list"]`, "get, list and watch pods"},
		{"wrong discovery port", "- --service-discovery-port\n            - \"50051\"", "- --service-discovery-port\n            - \"80\"", "gRPC port"},
		{"wrong backend", "- --backend\n            - vllm", "- --backend\n            - sglang", "--backend must be vllm"},
		// the fence (netpol.go) and the keys
		{"grpc admitted from every pod", "- from:\n        - podSelector:\n            matchLabels:\n              app.kubernetes.io/name: ferrum-service-gateway\n              app.kubernetes.io/instance: ferrum-service\n", "- from:\n        - podSelector: {}\n", "pods like"},
		{"grpc admitted from anywhere", "  ingress:\n    # gRPC (both protocols) from the gateway pods only\n", "  ingress:\n    - ports: [{port: 50051}]\n", "any source"},
		{"grpc admitted from a namespace", "        - podSelector:\n            matchLabels:\n              app.kubernetes.io/name: ferrum-service-gateway\n              app.kubernetes.io/instance: ferrum-service\n      ports:", "        - namespaceSelector: {}\n      ports:", "other namespaces"},
		{"no policy for the workers", "    matchLabels:\n      app.kubernetes.io/name: ferrum-service\n      app.kubernetes.io/instance: ferrum-service\n      app.kubernetes.io/component: model-executor\n  policyTypes", "    matchLabels:\n      app.kubernetes.io/name: nothing\n  policyTypes", "no NetworkPolicy selects"},
		{"gateway not admitted", "              app.kubernetes.io/name: ferrum-service-gateway\n              app.kubernetes.io/instance: ferrum-service\n      ports:", "              app.kubernetes.io/name: ferrum-service-gateway\n              app.kubernetes.io/instance: other\n      ports:", "does not admit the gateway"},
		{"pd: decode pods not admitted to prefill", "              ferrum.io/role: decode\n      ports:", "              ferrum.io/role: prefill\n      ports:", "pods like"},
		{"pd: shared prefixes asked for but not configured", "    vllm_shared_prefix_cache: true\n", "", "vllm_shared_prefix_cache"},
		{"no API key", "            - --api-key\n            - \"$(SMG_API_KEY)\"\n", "", "--api-key is missing"},
		{"API key not from a Secret", "            - name: SMG_API_KEY\n              valueFrom:", "            - name: SMG_API_KEX\n              valueFrom:", "does not come from a Secret"},
		{"control-plane key is the API key", "key: control-plane-key", "key: api-key", "same Secret key"},
		{"control-plane key not admin", "chart:operator:admin:", "chart:operator:user:", "expected form"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			src, want := good, Expect{Metrics: true, Gateway: true}
			if strings.HasPrefix(c.name, "pd:") {
				src, want = pd, Expect{Metrics: true, Gateway: true, Roles: true, SharedPrefix: true}
			}
			bad := strings.Replace(string(src), c.from, c.to, 1)
			if bad == string(src) {
				t.Fatalf("the rendering has no %q to break", c.from)
			}
			objs := decodeOK(t, "helm:gateway-broken.yaml", []byte(bad))
			errs := Check(objs, want)
			found := false
			for _, e := range errs {
				if strings.Contains(e.Error(), c.want) {
					found = true
				}
			}
			if !found {
				t.Fatalf("no error mentions %q: %v", c.want, errs)
			}
			t.Logf("rejected as expected: %v", errs[0])
		})
	}
}

// deploy/llm-d: the InferencePool and its endpoint picker, decoded strictly (the pool into
// gateway-api-inference-extension's api/v1 type) and checked against the worker Deployments of the
// plain manifests and, when rendered, of the Helm chart (release ferrum-service); then broken
// variants, each of which must be refused.
func TestLlmdInferencePool(t *testing.T) {
	file := filepath.Join(root, "deploy", "llm-d", "inferencepool.yaml")
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	workersOf := func(objs []Object) []*appsv1.Deployment {
		var out []*appsv1.Deployment
		for _, o := range objs {
			if d, ok := o.Obj.(*appsv1.Deployment); ok {
				out = append(out, d)
			}
		}
		return out
	}
	workers := workersOf(decodeOK(t, "kustomize:cpu", build(t, k8sDir("base"))))
	if dir := os.Getenv("FERRUM_RENDERED"); dir != "" {
		for _, f := range []string{"default.yaml", "gpu.yaml", "roles.yaml"} {
			rendered, err := os.ReadFile(filepath.Join(dir, f))
			if err != nil {
				t.Fatal(err)
			}
			workers = append(workers, workersOf(decodeOK(t, "helm:"+f, rendered))...)
		}
	}
	objs := decodeOK(t, file, data)
	for _, e := range CheckInferencePool(objs, workers) {
		t.Error(e)
	}
	t.Logf("%d objects validated against %d worker Deployments: %s", len(objs), len(workers), Summary(objs))

	broken := []struct{ name, from, to, want string }{
		{"http-app-protocol", "appProtocol: kubernetes.io/h2c", "appProtocol: http", "appProtocol"},
		{"wrong-target-port", "- number: 50051", "- number: 8000", "targetPorts"},
		{"misspelt-field", "targetPorts:", "targetPort:", "targetPort"},
		{"selector-misses-workers", "app.kubernetes.io/component: model-executor", "app.kubernetes.io/component: worker", "does not match"},
		{"openai-parser", "- type: vllmgrpc-parser", "- type: openai-parser", "vllmgrpc-parser"},
		{"undeclared-plugin", "- pluginRef: prefix-cache-scorer", "- pluginRef: prefix-scorer", "does not declare"},
		{"metrics-on-grpc-port", "port: 9090\n      - type: core-metrics-extractor", "port: 50051\n      - type: core-metrics-extractor", "metrics port"},
		{"epp-ref-port", "number: 9002", "number: 9009", "port 9009"},
		{"pool-name", "- --pool-name\n            - ferrum-service", "- --pool-name\n            - other", "--pool-name"},
		{"no-pod-rbac", "resources: [\"pods\"]", "resources: [\"services\"]", "ServiceAccount"},
	}
	for _, b := range broken {
		t.Run("broken-"+b.name, func(t *testing.T) {
			if !strings.Contains(string(data), b.from) {
				t.Fatalf("the manifest no longer has %q", b.from)
			}
			bad := strings.Replace(string(data), b.from, b.to, 1)
			objs, errs := DecodeAll(b.name, []byte(bad))
			if len(errs) == 0 {
				errs = CheckInferencePool(objs, workers)
			}
			if len(errs) == 0 {
				t.Fatal("accepted")
			}
			all := fmt.Sprint(errs)
			if !strings.Contains(all, b.want) {
				t.Fatalf("refused, but not for %q: %v", b.want, all)
			}
			t.Logf("rejected as expected: %v", errs[0])
		})
	}
}
