package validate

import (
	"fmt"
	"path"
	"sort"
	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/labels"
	infv1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	"sigs.k8s.io/yaml"
)

// MetricsPort is the workers' Prometheus port (the llm-d model-server metrics are there).
const MetricsPort = 9090

// eppConfigKeys are the top-level fields of llm-d-router v0.10.0's EndpointPickerConfig
// (apix/config/v1alpha1): its Go module is not served by the module proxy this project can reach,
// so the config is checked by these names and by its references, not decoded into that type.
var eppConfigKeys = map[string]bool{
	"apiVersion": true, "kind": true, "featureGates": true, "plugins": true, "schedulingProfiles": true,
	"dataLayer": true, "flowControl": true, "requestHandler": true, "saturationDetector": true, "parser": true,
}

// CheckInferencePool checks deploy/llm-d's objects (decoded strictly: the InferencePool into
// gateway-api-inference-extension's own api/v1 type) against the worker Deployments they front:
// the pool selects every worker pod and no EPP pod, targets the workers' gRPC port over h2c, and
// names the EPP Service, whose selector finds the EPP Deployment; the EPP serves that pool with a
// config (from the ConfigMap it mounts) that parses vLLM's gRPC protocol (vllmgrpc-parser), scrapes
// the workers' metrics port and refers only to plugins it declares; its ServiceAccount may read
// pods and InferencePools.
func CheckInferencePool(objs []Object, workers []*appsv1.Deployment) []error {
	var errs []error
	fail := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }
	var pools []*infv1.InferencePool
	var deps []*appsv1.Deployment
	svcs := map[string]*corev1.Service{}
	cms := map[string]*corev1.ConfigMap{}
	var roles []*rbacv1.Role
	var bindings []*rbacv1.RoleBinding
	for _, o := range objs {
		switch v := o.Obj.(type) {
		case *infv1.InferencePool:
			pools = append(pools, v)
		case *appsv1.Deployment:
			deps = append(deps, v)
		case *corev1.Service:
			svcs[v.Name] = v
		case *corev1.ConfigMap:
			cms[v.Name] = v
		case *rbacv1.Role:
			roles = append(roles, v)
		case *rbacv1.RoleBinding:
			bindings = append(bindings, v)
		}
	}
	if len(pools) != 1 || len(deps) != 1 {
		fail("want one InferencePool and one (EPP) Deployment, got %d and %d", len(pools), len(deps))
		return errs
	}
	pool, epp := pools[0], deps[0]
	s := pool.Spec
	sel := labels.Set{}
	for k, v := range s.Selector.MatchLabels {
		sel[string(k)] = string(v)
	}
	if len(sel) == 0 {
		fail("InferencePool %s: spec.selector.matchLabels is empty", pool.Name)
	}
	poolSel := labels.SelectorFromSet(sel)
	if len(workers) == 0 {
		fail("no worker Deployment to check the pool against")
	}
	for _, w := range workers {
		if !poolSel.Matches(labels.Set(w.Spec.Template.Labels)) {
			fail("InferencePool %s: selector %v does not match the pods of worker Deployment %s (%v)",
				pool.Name, sel, w.Name, w.Spec.Template.Labels)
		}
		if !hasContainerPort(w, GRPCPort) || !hasContainerPort(w, MetricsPort) {
			fail("worker Deployment %s does not serve gRPC on %d and metrics on %d", w.Name, GRPCPort, MetricsPort)
		}
	}
	if poolSel.Matches(labels.Set(epp.Spec.Template.Labels)) {
		fail("InferencePool %s selects the EPP's own pods", pool.Name)
	}
	if len(s.TargetPorts) != 1 || int(s.TargetPorts[0].Number) != GRPCPort {
		fail("InferencePool %s: targetPorts must be the workers' gRPC port %d, got %v", pool.Name, GRPCPort, s.TargetPorts)
	}
	if s.AppProtocol != infv1.AppProtocolH2C {
		fail("InferencePool %s: appProtocol must be %q (gRPC), got %q", pool.Name, infv1.AppProtocolH2C, s.AppProtocol)
	}
	ref := s.EndpointPickerRef
	if ref == nil || ref.Port == nil {
		fail("InferencePool %s: endpointPickerRef with a port is required", pool.Name)
		return errs
	}
	if (ref.Kind != "" && ref.Kind != "Service") || (ref.Group != nil && *ref.Group != "") {
		fail("InferencePool %s: endpointPickerRef must name a core Service", pool.Name)
	}
	if ref.FailureMode != "" && ref.FailureMode != infv1.EndpointPickerFailOpen && ref.FailureMode != infv1.EndpointPickerFailClose {
		fail("InferencePool %s: failureMode %q is neither FailOpen nor FailClose", pool.Name, ref.FailureMode)
	}
	svc := svcs[string(ref.Name)]
	switch {
	case svc == nil:
		fail("InferencePool %s: endpointPickerRef names Service %q, which is not in the manifest", pool.Name, ref.Name)
	default:
		if !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(epp.Spec.Template.Labels)) || len(svc.Spec.Selector) == 0 {
			fail("Service %s does not select the EPP Deployment's pods", svc.Name)
		}
		found := false
		for _, p := range svc.Spec.Ports {
			if p.Port == int32(ref.Port.Number) {
				found = true
				if cp := containerPort(epp, p.TargetPort.String()); cp != 9002 {
					fail("Service %s port %d does not reach the EPP's ext-proc port 9002", svc.Name, p.Port)
				}
			}
		}
		if !found {
			fail("Service %s has no port %d (endpointPickerRef.port)", svc.Name, ref.Port.Number)
		}
	}
	errs = append(errs, checkEPP(pool, epp, cms, roles, bindings)...)
	return errs
}

func checkEPP(pool *infv1.InferencePool, epp *appsv1.Deployment, cms map[string]*corev1.ConfigMap,
	roles []*rbacv1.Role, bindings []*rbacv1.RoleBinding) []error {
	var errs []error
	fail := func(format string, a ...any) { errs = append(errs, fmt.Errorf("EPP %s: "+format, append([]any{epp.Name}, a...)...)) }
	pod := epp.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		fail("want one container, got %d", len(pod.Containers))
		return errs
	}
	c := pod.Containers[0]
	flag := func(name string) string {
		for i, a := range c.Args {
			if a == name && i+1 < len(c.Args) {
				return c.Args[i+1]
			}
			if v, ok := strings.CutPrefix(a, name+"="); ok {
				return v
			}
		}
		return ""
	}
	if flag("--pool-name") != pool.Name {
		fail("--pool-name must be %q", pool.Name)
	}
	if g := flag("--pool-group"); g != "" && g != infv1.GroupName {
		fail("--pool-group must be %q, got %q", infv1.GroupName, g)
	}
	// The config file: a key of a ConfigMap mounted at its directory.
	file := flag("--config-file")
	var cfgText string
	for _, m := range c.VolumeMounts {
		if path.Dir(file) != path.Clean(m.MountPath) {
			continue
		}
		for _, v := range pod.Volumes {
			if v.Name == m.Name && v.ConfigMap != nil {
				if cm := cms[v.ConfigMap.Name]; cm != nil {
					cfgText = cm.Data[path.Base(file)]
				}
			}
		}
	}
	if cfgText == "" {
		fail("--config-file %q is not a key of a ConfigMap mounted there", file)
	} else {
		for _, e := range checkEPPConfig(cfgText) {
			fail("config: %v", e)
		}
	}
	// RBAC: the pod's ServiceAccount can read pods and InferencePools.
	sa := pod.ServiceAccountName
	can := func(group, resource string) bool {
		for _, b := range bindings {
			bound := false
			for _, s := range b.Subjects {
				bound = bound || (s.Kind == "ServiceAccount" && s.Name == sa)
			}
			if !bound || b.RoleRef.Kind != "Role" {
				continue
			}
			for _, r := range roles {
				if r.Name == b.RoleRef.Name && roleAllows(r, group, resource, "get", "list", "watch") {
					return true
				}
			}
		}
		return false
	}
	if sa == "" || !can("", "pods") || !can(infv1.GroupName, "inferencepools") {
		fail("ServiceAccount %q must be bound to a Role that can get, list and watch pods and inferencepools", sa)
	}
	return errs
}

func checkEPPConfig(text string) []error {
	var errs []error
	var cfg map[string]any
	if err := yaml.UnmarshalStrict([]byte(text), &cfg); err != nil {
		return []error{err}
	}
	if cfg["apiVersion"] != "llm-d.ai/v1alpha1" || cfg["kind"] != "EndpointPickerConfig" {
		errs = append(errs, fmt.Errorf("want llm-d.ai/v1alpha1 EndpointPickerConfig, got %v %v", cfg["apiVersion"], cfg["kind"]))
	}
	var unknown []string
	for k := range cfg {
		if !eppConfigKeys[k] {
			unknown = append(unknown, k)
		}
	}
	sort.Strings(unknown)
	if len(unknown) > 0 {
		errs = append(errs, fmt.Errorf("unknown fields %v", unknown))
	}
	// Plugins by name (a plugin without a name is referred to by its type).
	plugins := map[string]map[string]any{}
	list, _ := cfg["plugins"].([]any)
	for _, p := range list {
		m, _ := p.(map[string]any)
		typ, _ := m["type"].(string)
		name, _ := m["name"].(string)
		if name == "" {
			name = typ
		}
		if typ == "" {
			errs = append(errs, fmt.Errorf("a plugin without a type: %v", p))
			continue
		}
		plugins[name] = m
	}
	refs := func(v any) []string { // pluginRef values anywhere under v
		var out []string
		var walk func(any)
		walk = func(x any) {
			switch t := x.(type) {
			case map[string]any:
				for k, y := range t {
					if s, ok := y.(string); ok && k == "pluginRef" {
						out = append(out, s)
					}
					walk(y)
				}
			case []any:
				for _, y := range t {
					walk(y)
				}
			}
		}
		walk(v)
		return out
	}
	for k, v := range cfg {
		if k == "plugins" {
			continue
		}
		for _, r := range refs(v) {
			if plugins[r] == nil {
				errs = append(errs, fmt.Errorf("%s refers to plugin %q, which plugins does not declare", k, r))
			}
		}
	}
	rh, _ := cfg["requestHandler"].(map[string]any)
	parsers := refs(rh["parsers"])
	if len(parsers) != 1 || plugins[parsers[0]] == nil || plugins[parsers[0]]["type"] != "vllmgrpc-parser" {
		errs = append(errs, fmt.Errorf("requestHandler.parsers must be the one vllmgrpc-parser (the workers speak "+
			"vLLM's gRPC engine protocol), got %v", parsers))
	}
	if profiles, _ := cfg["schedulingProfiles"].([]any); len(profiles) == 0 {
		errs = append(errs, fmt.Errorf("no schedulingProfiles"))
	}
	scraped := false
	for _, p := range plugins {
		if p["type"] != "metrics-data-source" {
			continue
		}
		params, _ := p["parameters"].(map[string]any)
		if port, ok := num(params["port"]); ok && int(port) == MetricsPort {
			scraped = true
		}
	}
	if !scraped {
		errs = append(errs, fmt.Errorf("no metrics-data-source scraping the workers' metrics port %d "+
			"(the pool's target port is gRPC)", MetricsPort))
	}
	return errs
}

func hasContainerPort(d *appsv1.Deployment, port int) bool {
	for _, c := range d.Spec.Template.Spec.Containers {
		for _, p := range c.Ports {
			if int(p.ContainerPort) == port {
				return true
			}
		}
	}
	return false
}

// containerPort resolves a Service targetPort (a number or a port name) on a Deployment's pods.
func containerPort(d *appsv1.Deployment, target string) int {
	for _, c := range d.Spec.Template.Spec.Containers {
		for _, p := range c.Ports {
			if p.Name == target || fmt.Sprint(p.ContainerPort) == target {
				return int(p.ContainerPort)
			}
		}
	}
	return 0
}

func roleAllows(r *rbacv1.Role, group, resource string, verbs ...string) bool {
	for _, rule := range r.Rules {
		if !contains(rule.APIGroups, group) || !contains(rule.Resources, resource) {
			continue
		}
		ok := true
		for _, v := range verbs {
			ok = ok && (contains(rule.Verbs, v) || contains(rule.Verbs, "*"))
		}
		if ok {
			return true
		}
	}
	return false
}

func contains(xs []string, want string) bool {
	for _, x := range xs {
		if x == want {
			return true
		}
	}
	return false
}
