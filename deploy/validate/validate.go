// Package validate decodes ferrum-service's Kubernetes objects strictly against Kubernetes' own API
// types (k8s.io/api, the Prometheus Operator's monitoring/v1, kustomize's own types) and checks what
// the service needs from them: gRPC health probes on the gRPC port, a startup budget long enough for
// model load, non-root with a read-only root filesystem, a termination grace period that covers the
// server's drain, a headless Service, GPU requests for the CUDA variant.
//
// Strict means: an unknown or misspelt field, a duplicate field or a value of the wrong type is an
// error (sigs.k8s.io/yaml.UnmarshalStrict: YAML to JSON, then a JSON decode that disallows unknown
// fields into the typed Go struct), and so is a kind this package does not know.
package validate

import (
	"bytes"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	kjson "sigs.k8s.io/json"
	kustomizetypes "sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/yaml"
)

// GRPCPort is the port the server serves the contract and grpc.health.v1 on.
const GRPCPort = 50051

// MinStartupSeconds is the least time the startup probe must allow: model load takes 30-60 s on
// CPU, so twice the upper end.
const MinStartupSeconds = 120

// DrainMarginSeconds is what terminationGracePeriodSeconds must exceed preStop + grace_period by.
const DrainMarginSeconds = 5

// Object is one decoded document.
type Object struct {
	Source     string // file (and document index) it came from
	APIVersion string
	Kind       string
	Name       string
	Obj        any // pointer to the typed struct
}

func (o Object) String() string {
	return fmt.Sprintf("%s %s/%s (%s)", o.APIVersion, o.Kind, o.Name, o.Source)
}

var docSep = regexp.MustCompile(`(?m)^---[ \t]*(#.*)?$`)

// SplitDocs splits a YAML stream into documents, dropping those that hold only comments or space.
func SplitDocs(data []byte) [][]byte {
	var out [][]byte
	for _, d := range docSep.Split(string(data), -1) {
		empty := true
		for _, ln := range strings.Split(d, "\n") {
			t := strings.TrimSpace(ln)
			if t != "" && !strings.HasPrefix(t, "#") {
				empty = false
				break
			}
		}
		if !empty {
			out = append(out, []byte(d))
		}
	}
	return out
}

// newTyped returns a pointer to the Go type for apiVersion/kind, or nil when unknown.
func newTyped(apiVersion, kind string) any {
	switch apiVersion + "/" + kind {
	case "v1/ConfigMap":
		return &corev1.ConfigMap{}
	case "v1/Secret":
		return &corev1.Secret{}
	case "v1/Service":
		return &corev1.Service{}
	case "v1/ServiceAccount":
		return &corev1.ServiceAccount{}
	case "apps/v1/Deployment":
		return &appsv1.Deployment{}
	case "networking.k8s.io/v1/NetworkPolicy":
		return &networkingv1.NetworkPolicy{}
	case "policy/v1/PodDisruptionBudget":
		return &policyv1.PodDisruptionBudget{}
	case "rbac.authorization.k8s.io/v1/Role":
		return &rbacv1.Role{}
	case "rbac.authorization.k8s.io/v1/RoleBinding":
		return &rbacv1.RoleBinding{}
	case "inference.networking.k8s.io/v1/InferencePool":
		return &infv1.InferencePool{}
	case "monitoring.coreos.com/v1/ServiceMonitor":
		return &monitoringv1.ServiceMonitor{}
	case "monitoring.coreos.com/v1/PrometheusRule":
		return &monitoringv1.PrometheusRule{}
	case "kustomize.config.k8s.io/v1beta1/Kustomization", "kustomize.config.k8s.io/v1alpha1/Component":
		return &kustomizetypes.Kustomization{}
	}
	return nil
}

// decodeStrict is how the API server decodes: YAML to JSON rejecting duplicate keys, then a
// case-SENSITIVE JSON decode that rejects unknown fields (sigs.k8s.io/json). Plain encoding/json
// with DisallowUnknownFields matches field names case-insensitively, so it would accept
// "readOnlyRootFileSystem" for readOnlyRootFilesystem (which the API server then drops).
func decodeStrict(doc []byte, obj any) error {
	js, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strictErrs, err := kjson.UnmarshalStrict(js, obj)
	if err != nil {
		return err
	}
	if len(strictErrs) > 0 {
		msgs := make([]string, len(strictErrs))
		for i, e := range strictErrs {
			msgs[i] = e.Error()
		}
		return errors.New(strings.Join(msgs, "; "))
	}
	return nil
}

// Decode decodes one document strictly into its Kubernetes type.
func Decode(source string, doc []byte) (Object, error) {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return Object{}, fmt.Errorf("%s: not YAML: %w", source, err)
	}
	if tm.APIVersion == "" || tm.Kind == "" {
		return Object{}, fmt.Errorf("%s: apiVersion and kind are required", source)
	}
	obj := newTyped(tm.APIVersion, tm.Kind)
	if obj == nil {
		return Object{}, fmt.Errorf("%s: unknown kind %s %s (add its Go type to validate.newTyped)", source, tm.APIVersion, tm.Kind)
	}
	if err := decodeStrict(doc, obj); err != nil {
		return Object{}, fmt.Errorf("%s: %s %s does not decode strictly: %w", source, tm.APIVersion, tm.Kind, err)
	}
	name := ""
	if m, ok := obj.(metav1.Object); ok {
		name = m.GetName()
	} else if k, ok := obj.(*kustomizetypes.Kustomization); ok && k.MetaData != nil {
		name = k.MetaData.Name
	}
	if name == "" && !strings.HasPrefix(tm.APIVersion, "kustomize.config.k8s.io/") {
		return Object{}, fmt.Errorf("%s: %s has no metadata.name", source, tm.Kind)
	}
	return Object{Source: source, APIVersion: tm.APIVersion, Kind: tm.Kind, Name: name, Obj: obj}, nil
}

// DecodeAll splits a stream and decodes every document; it returns every error, not just the first.
func DecodeAll(source string, data []byte) ([]Object, []error) {
	var objs []Object
	var errs []error
	for i, d := range SplitDocs(data) {
		o, err := Decode(fmt.Sprintf("%s#%d", source, i), d)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		objs = append(objs, o)
	}
	return objs, errs
}

// Expect says which variant a set of objects is.
type Expect struct {
	GPU            bool // the CUDA variant: nvidia.com/gpu requested
	TLS            bool // TLS on: probes are exec health checks (the kubelet's gRPC probes are plaintext)
	Metrics        bool // a metrics port with prometheus.io annotations or a ServiceMonitor
	ServiceMonitor bool // a ServiceMonitor is expected
	PrometheusRule bool // a PrometheusRule (the chart's alerts) is expected, and none otherwise
	Roles          bool // disaggregated: one prefill and one decode Deployment (--role), each checked in full
	Gateway        bool // the SMG gateway Deployment in front of the workers (see gateway.go), fenced (netpol.go)
	SharedPrefix   bool // the workers share one prefix-cache space across the gateway's users (gateway.sharedPrefixCache)
}

// ServerConfigKeys are the keys the server's config file understands (the long names of the
// `serve` flags, plus models, reflection and trust_remote_code).
var ServerConfigKeys = map[string]bool{
	"models": true, "host": true, "port": true, "metrics_port": true, "device": true, "dtype": true,
	"kv_budget_tokens": true, "max_message_bytes": true, "max_batch": true, "grace_period": true,
	"log_format": true, "log_level": true, "tls_cert": true, "tls_key": true, "tls_client_ca": true,
	"auth_token_file": true, "admin_token_file": true, "reflection": true, "trust_remote_code": true, "role": true,
	"stall_timeout": true, "max_caches": true, "max_caches_per_caller": true, "max_compile_seconds": true,
	"vllm_shared_prefix_cache": true, "open_admin_rpcs": true,
	"hub_token_file": true,
}

type serverConfig struct {
	raw         map[string]any
	port        int
	metricsPort int
	grace       float64
}

func num(v any) (float64, bool) {
	switch x := v.(type) {
	case float64:
		return x, true
	case int:
		return float64(x), true
	case int64:
		return float64(x), true
	case string:
		f, err := strconv.ParseFloat(x, 64)
		return f, err == nil
	}
	return 0, false
}

func parseServerConfig(text string) (serverConfig, error) {
	c := serverConfig{port: GRPCPort, metricsPort: 9090, grace: 20}
	if err := yaml.Unmarshal([]byte(text), &c.raw); err != nil {
		return c, fmt.Errorf("config.yaml is not YAML: %w", err)
	}
	var keys []string
	for k := range c.raw {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !ServerConfigKeys[strings.ReplaceAll(k, "-", "_")] {
			return c, fmt.Errorf("config.yaml: unknown key %q (the server would ignore it)", k)
		}
	}
	models, ok := c.raw["models"].([]any)
	if !ok || len(models) == 0 {
		return c, fmt.Errorf("config.yaml: models must be a non-empty list")
	}
	for i, m := range models {
		mm, ok := m.(map[string]any)
		if !ok || mm["executor"] == nil {
			return c, fmt.Errorf("config.yaml: models[%d] needs an executor", i)
		}
	}
	for key, dst := range map[string]*int{"port": &c.port, "metrics_port": &c.metricsPort} {
		if v, ok := c.raw[key]; ok {
			f, ok := num(v)
			if !ok {
				return c, fmt.Errorf("config.yaml: %s is not a number", key)
			}
			*dst = int(f)
		}
	}
	if v, ok := c.raw["grace_period"]; ok {
		f, ok := num(v)
		if !ok {
			return c, fmt.Errorf("config.yaml: grace_period is not a number")
		}
		c.grace = f
	}
	return c, nil
}

// Check runs the semantic checks on one variant's objects and returns every problem found.
func Check(objs []Object, want Expect) []error {
	var errs []error
	fail := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }

	var deps []*appsv1.Deployment
	var svcs []*corev1.Service
	var pdbs []*policyv1.PodDisruptionBudget
	var sms []*monitoringv1.ServiceMonitor
	var rules []*monitoringv1.PrometheusRule
	cms := map[string]*corev1.ConfigMap{}
	var gateways []*appsv1.Deployment
	for _, o := range objs {
		switch x := o.Obj.(type) {
		case *appsv1.Deployment:
			if x.Spec.Template.Labels["app.kubernetes.io/component"] == "gateway" {
				gateways = append(gateways, x)
				continue
			}
			deps = append(deps, x)
		case *corev1.Service:
			svcs = append(svcs, x)
		case *policyv1.PodDisruptionBudget:
			pdbs = append(pdbs, x)
		case *monitoringv1.ServiceMonitor:
			sms = append(sms, x)
		case *monitoringv1.PrometheusRule:
			rules = append(rules, x)
		case *corev1.ConfigMap:
			cms[x.Name] = x
		}
	}
	if want.PrometheusRule != (len(rules) > 0) {
		fail("PrometheusRule: want %v, got %d", want.PrometheusRule, len(rules))
	}
	for _, r := range rules {
		if len(r.Spec.Groups) == 0 || len(r.Spec.Groups[0].Rules) == 0 {
			fail("PrometheusRule %s: no rules", r.Name)
		}
	}
	switch {
	case want.Gateway && len(gateways) != 1:
		fail("want exactly one gateway Deployment, got %d", len(gateways))
	case want.Gateway:
		errs = append(errs, checkGateway(gateways[0], deps, objs)...)
		errs = append(errs, checkGatewayFence(gateways[0], deps, objs, want.Metrics)...)
		errs = append(errs, checkGatewayKeys(gateways[0])...)
	case len(gateways) > 0:
		fail("a gateway Deployment (%s) where none was asked for", gateways[0].Name)
	}
	// The workers' checks see the Services around the workers, not the gateway's own.
	workerSvcs := svcs[:0:0]
	for _, s := range svcs {
		mine := false
		for _, g := range gateways {
			if len(s.Spec.Selector) > 0 && labels.SelectorFromSet(s.Spec.Selector).Matches(labels.Set(g.Spec.Template.Labels)) {
				mine = true
			}
		}
		if !mine {
			workerSvcs = append(workerSvcs, s)
		}
	}
	svcs = workerSvcs
	if !want.Roles {
		if len(deps) != 1 {
			fail("want exactly one Deployment, got %d", len(deps))
			return errs
		}
		if got := deps[0].Spec.Template.Labels["llm-d.ai/role"]; got != "" && got != "both" {
			fail("Deployment %s: pod label llm-d.ai/role is %q for a server of both roles; want \"both\"", deps[0].Name, got)
		}
		return append(errs, checkDeployment(deps[0], svcs, pdbs, sms, cms, want)...)
	}
	// Two roles: a prefill and a decode Deployment, each with every check of a single one, against
	// the Services and PodDisruptionBudgets that select its pods.
	if len(deps) != 2 {
		fail("roles: want a prefill and a decode Deployment, got %d Deployments", len(deps))
		return errs
	}
	seen := map[string]bool{}
	for _, d := range deps {
		role := ""
		if cs := d.Spec.Template.Spec.Containers; len(cs) == 1 {
			for i, a := range cs[0].Args {
				if a == "--role" && i+1 < len(cs[0].Args) {
					role = cs[0].Args[i+1]
				}
			}
		}
		if role != "prefill" && role != "decode" {
			fail("Deployment %s: container args must pass --role prefill or --role decode, got %q", d.Name, role)
		}
		seen[role] = true
		if got := d.Spec.Template.Labels["llm-d.ai/role"]; got != role {
			fail("Deployment %s: pod label llm-d.ai/role is %q; llm-d's schedulers need %q", d.Name, got, role)
		}
		podLabels := labels.Set(d.Spec.Template.Labels)
		var mine []*corev1.Service
		for _, s := range svcs {
			if len(s.Spec.Selector) > 0 && labels.SelectorFromSet(s.Spec.Selector).Matches(podLabels) {
				mine = append(mine, s)
			}
		}
		for _, e := range checkDeployment(d, mine, pdbs, sms, cms, want) {
			fail("Deployment %s: %v", d.Name, e)
		}
	}
	if !seen["prefill"] || !seen["decode"] {
		fail("roles: want one prefill and one decode Deployment")
	}
	return errs
}

// checkDeployment: every check of one Deployment and the objects around it.
func checkDeployment(d *appsv1.Deployment, svcs []*corev1.Service, pdbs []*policyv1.PodDisruptionBudget,
	sms []*monitoringv1.ServiceMonitor, cms map[string]*corev1.ConfigMap, want Expect) []error {
	var errs []error
	fail := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	var err error
	pod := d.Spec.Template
	podLabels := labels.Set(pod.Labels)

	// Selector matches the template.
	sel, err := metav1.LabelSelectorAsSelector(d.Spec.Selector)
	_ = err
	if err != nil || d.Spec.Selector == nil || sel.Empty() || !sel.Matches(podLabels) {
		fail("Deployment %s: spec.selector does not match the pod template's labels", d.Name)
	}
	if d.Spec.Replicas != nil && *d.Spec.Replicas < 1 {
		fail("Deployment %s: replicas < 1", d.Name)
	}

	// Pod security.
	psc := pod.Spec.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
		fail("pod securityContext.runAsNonRoot must be true")
	}
	if psc == nil || psc.RunAsUser == nil || *psc.RunAsUser == 0 {
		fail("pod securityContext.runAsUser must be set and non-zero")
	}
	if psc == nil || psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		fail("pod securityContext.seccompProfile.type must be RuntimeDefault")
	}
	if pod.Spec.AutomountServiceAccountToken == nil || *pod.Spec.AutomountServiceAccountToken {
		fail("automountServiceAccountToken must be false (the server never calls the API)")
	}

	if len(pod.Spec.Containers) != 1 {
		fail("want one container, got %d", len(pod.Spec.Containers))
		return errs
	}
	c := pod.Spec.Containers[0]
	sc := c.SecurityContext
	if sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem {
		fail("container securityContext.readOnlyRootFilesystem must be true")
	}
	if sc == nil || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		fail("container securityContext.allowPrivilegeEscalation must be false")
	}
	if sc == nil || sc.Capabilities == nil || !containsCap(sc.Capabilities.Drop, "ALL") || len(sc.Capabilities.Add) > 0 {
		fail("container must drop ALL capabilities and add none")
	}
	if sc != nil && sc.Privileged != nil && *sc.Privileged {
		fail("container must not be privileged")
	}

	// /tmp is a writable emptyDir (the root fs is read-only).
	vols := map[string]corev1.Volume{}
	for _, v := range pod.Spec.Volumes {
		vols[v.Name] = v
	}
	tmpOK := false
	for _, m := range c.VolumeMounts {
		v, ok := vols[m.Name]
		if !ok {
			fail("volumeMount %s names no volume", m.Name)
			continue
		}
		if m.MountPath == "/tmp" && v.EmptyDir != nil && !m.ReadOnly {
			tmpOK = true
		}
	}
	if !tmpOK {
		fail("/tmp must be a writable emptyDir mount")
	}

	// Ports.
	ports := map[string]int32{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	if ports["grpc"] != GRPCPort {
		fail("container port grpc must be %d, got %d", GRPCPort, ports["grpc"])
	}

	// Server config from the ConfigMap.
	var cfg serverConfig
	cfgFound := false
	for _, v := range pod.Spec.Volumes {
		if v.ConfigMap == nil {
			continue
		}
		cm, ok := cms[v.ConfigMap.Name]
		if !ok {
			fail("volume %s references ConfigMap %s, which is not among the objects", v.Name, v.ConfigMap.Name)
			continue
		}
		text, ok := cm.Data["config.yaml"]
		if !ok {
			fail("ConfigMap %s has no config.yaml", cm.Name)
			continue
		}
		cfg, err = parseServerConfig(text)
		if err != nil {
			fail("ConfigMap %s: %v", cm.Name, err)
			continue
		}
		cfgFound = true
		if !argsContain(c.Args, "--config") {
			fail("container args must pass --config (the ConfigMap is mounted but unused)")
		}
	}
	if !cfgFound {
		fail("no ConfigMap with the server's config.yaml is mounted")
	} else if cfg.port != GRPCPort {
		fail("config.yaml port %d differs from the gRPC port %d", cfg.port, GRPCPort)
	}
	if shared, _ := cfg.raw["vllm_shared_prefix_cache"].(bool); cfgFound && shared != want.SharedPrefix {
		fail("config.yaml vllm_shared_prefix_cache is %v, want %v: the gateway's users share cached prefixes only when asked (gateway.sharedPrefixCache)", shared, want.SharedPrefix)
	}

	// Probes.
	for name, p := range map[string]*corev1.Probe{"startupProbe": c.StartupProbe, "readinessProbe": c.ReadinessProbe, "livenessProbe": c.LivenessProbe} {
		if p == nil {
			fail("%s is missing", name)
			continue
		}
		if want.TLS {
			if p.Exec == nil || !argsContain(p.Exec.Command, "/opt/ferrum/healthcheck.py") || !argsContain(p.Exec.Command, strconv.Itoa(GRPCPort)) {
				fail("%s: with TLS on, must exec /opt/ferrum/healthcheck.py %d (kubelet gRPC probes are plaintext)", name, GRPCPort)
			}
			continue
		}
		if p.GRPC == nil {
			fail("%s must be a native grpc probe (grpc.health.v1)", name)
			continue
		}
		if p.GRPC.Port != GRPCPort {
			fail("%s: grpc port must be %d, got %d", name, GRPCPort, p.GRPC.Port)
		}
		// liveness asks the "liveness" service (up while the process answers, through drains and
		// slow steps: audit L12); startup and readiness ask the overall service ""
		wantService := ""
		if name == "livenessProbe" {
			wantService = "liveness"
		}
		if got := ptrOr(p.GRPC.Service, ""); got != wantService {
			fail("%s: checks service %q; it must check %q", name, got, wantService)
		}
	}
	if p := c.StartupProbe; p != nil {
		budget := probeBudget(p)
		if budget < MinStartupSeconds {
			fail("startupProbe allows %d s; model load needs at least %d s", budget, MinStartupSeconds)
		}
	}

	// Termination grace period covers preStop + the server's drain.
	preStop := 0
	if c.Lifecycle != nil && c.Lifecycle.PreStop != nil {
		ps := c.Lifecycle.PreStop
		switch {
		case ps.Sleep != nil:
			preStop = int(ps.Sleep.Seconds)
		case ps.Exec != nil && len(ps.Exec.Command) == 2 && ps.Exec.Command[0] == "sleep":
			preStop, err = strconv.Atoi(ps.Exec.Command[1])
			if err != nil {
				fail("preStop sleep %q is not a whole number of seconds", ps.Exec.Command[1])
			}
		}
	}
	tgp := int64(corev1.DefaultTerminationGracePeriodSeconds)
	if pod.Spec.TerminationGracePeriodSeconds != nil {
		tgp = *pod.Spec.TerminationGracePeriodSeconds
	}
	if need := float64(preStop) + cfg.grace + DrainMarginSeconds; float64(tgp) < need {
		fail("terminationGracePeriodSeconds %d < preStop %d + grace_period %g + margin %d", tgp, preStop, cfg.grace, DrainMarginSeconds)
	}

	// Resources.
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if _, ok := c.Resources.Requests[r]; !ok {
			fail("resources.requests.%s is missing", r)
		}
	}
	if _, ok := c.Resources.Limits[corev1.ResourceMemory]; !ok {
		fail("resources.limits.memory is missing")
	}
	gpu := corev1.ResourceName("nvidia.com/gpu")
	if want.GPU {
		q, ok := c.Resources.Limits[gpu]
		if !ok || q.Value() < 1 {
			fail("GPU variant: resources.limits[nvidia.com/gpu] must be >= 1")
		}
	} else if _, ok := c.Resources.Limits[gpu]; ok {
		fail("CPU variant requests nvidia.com/gpu")
	}

	// Metrics.
	if want.Metrics {
		mp, ok := ports["metrics"]
		if !ok {
			fail("metrics: the container has no port named metrics")
		} else if int(mp) != cfg.metricsPort {
			fail("metrics: container port %d differs from config.yaml metrics_port %d", mp, cfg.metricsPort)
		}
		a := pod.Annotations
		annotated := a["prometheus.io/scrape"] == "true" && a["prometheus.io/port"] == strconv.Itoa(int(mp)) && a["prometheus.io/path"] == "/metrics"
		if !annotated && len(sms) == 0 {
			fail("metrics: neither prometheus.io/{scrape,port,path} pod annotations nor a ServiceMonitor")
		}
	}
	if want.ServiceMonitor && len(sms) == 0 {
		fail("a ServiceMonitor is expected")
	}
	for _, sm := range sms {
		s, err := metav1.LabelSelectorAsSelector(&sm.Spec.Selector)
		if err != nil || s.Empty() {
			fail("ServiceMonitor %s: bad or empty selector", sm.Name)
			continue
		}
		matched := false
		for _, svc := range svcs {
			if s.Matches(labels.Set(svc.Labels)) && servicePort(svc, "metrics") {
				matched = true
			}
		}
		if !matched {
			fail("ServiceMonitor %s selects no Service with a port named metrics", sm.Name)
		}
		for _, ep := range sm.Spec.Endpoints {
			if ep.Port != "metrics" {
				fail("ServiceMonitor %s: endpoint must scrape the port named metrics", sm.Name)
			}
		}
	}

	// Services: one ClusterIP, one headless; both select the pods and target named container ports.
	var headless, balanced int
	for _, s := range svcs {
		if len(s.Spec.Selector) == 0 || !labels.SelectorFromSet(s.Spec.Selector).Matches(podLabels) {
			fail("Service %s does not select the Deployment's pods", s.Name)
		}
		for _, p := range s.Spec.Ports {
			if p.TargetPort.StrVal != "" {
				if _, ok := ports[p.TargetPort.StrVal]; !ok {
					fail("Service %s port %s targets %q, which the container does not name", s.Name, p.Name, p.TargetPort.StrVal)
				}
			}
		}
		if !servicePort(s, "grpc") {
			fail("Service %s has no port named grpc", s.Name)
		}
		if s.Spec.ClusterIP == corev1.ClusterIPNone {
			headless++
			if s.Spec.PublishNotReadyAddresses {
				fail("headless Service %s publishes not-ready pods (draining replicas would get new sessions)", s.Name)
			}
		} else {
			balanced++
		}
	}
	if headless != 1 && !(want.Roles && headless == 2) {
		// Two roles: the headless Service of every pod, and the one of this role's pods.
		fail("want one headless Service (clusterIP: None), got %d", headless)
	}
	if balanced != 1 {
		fail("want one load-balanced Service, got %d", balanced)
	}

	// PodDisruptionBudget.
	if len(pdbs) != 1 {
		fail("want one PodDisruptionBudget, got %d", len(pdbs))
	}
	for _, p := range pdbs {
		s, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
		if err != nil || p.Spec.Selector == nil || s.Empty() || !s.Matches(podLabels) {
			fail("PodDisruptionBudget %s does not select the Deployment's pods", p.Name)
		}
		if (p.Spec.MaxUnavailable == nil) == (p.Spec.MinAvailable == nil) {
			fail("PodDisruptionBudget %s: set exactly one of minAvailable / maxUnavailable", p.Name)
		}
	}
	return errs
}

func probeBudget(p *corev1.Probe) int {
	period, fails := p.PeriodSeconds, p.FailureThreshold
	if period == 0 {
		period = 10
	}
	if fails == 0 {
		fails = 3
	}
	return int(p.InitialDelaySeconds + period*fails)
}

func containsCap(caps []corev1.Capability, want corev1.Capability) bool {
	for _, c := range caps {
		if c == want {
			return true
		}
	}
	return false
}

func argsContain(args []string, want string) bool {
	for _, a := range args {
		if a == want {
			return true
		}
	}
	return false
}

func servicePort(s *corev1.Service, name string) bool {
	for _, p := range s.Spec.Ports {
		if p.Name == name {
			return true
		}
	}
	return false
}

// Summary renders "Kind/name" for each object, sorted, for test logs.
func Summary(objs []Object) string {
	var b bytes.Buffer
	names := make([]string, 0, len(objs))
	for _, o := range objs {
		names = append(names, o.Kind+"/"+o.Name)
	}
	sort.Strings(names)
	b.WriteString(strings.Join(names, " "))
	return b.String()
}

func ptrOr(p *string, def string) string {
	if p == nil {
		return def
	}
	return *p
}
