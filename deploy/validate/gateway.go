package validate

import (
	"fmt"
	"strconv"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// checkGateway: the SMG gateway Deployment (gateway.enabled) against the worker Deployments and
// the objects around it. It must find the workers by itself: --service-discovery with a selector
// that matches the worker pods (and only labels they carry), the workers' gRPC port, this
// namespace, --backend vllm; a ServiceAccount bound to a Role that can get, list and watch pods; a
// Service for its HTTP port. Its own pods must not be selected by the workers' Deployments,
// Services or PodDisruptionBudgets (they would count it as a worker).
func checkGateway(g *appsv1.Deployment, workers []*appsv1.Deployment, objs []Object) []error {
	var errs []error
	fail := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("gateway %s: "+format, append([]any{g.Name}, a...)...))
	}
	pod := g.Spec.Template
	podLabels := labels.Set(pod.Labels)
	sel, err := metav1.LabelSelectorAsSelector(g.Spec.Selector)
	if err != nil || g.Spec.Selector == nil || sel.Empty() || !sel.Matches(podLabels) {
		fail("spec.selector does not match the pod template's labels")
	}
	if len(pod.Spec.Containers) != 1 {
		fail("want one container, got %d", len(pod.Spec.Containers))
		return errs
	}
	c := pod.Spec.Containers[0]
	flag := func(name string) (string, bool) {
		for i, a := range c.Args {
			if a == name {
				if i+1 < len(c.Args) {
					return c.Args[i+1], true
				}
				return "", true
			}
		}
		return "", false
	}
	if v, _ := flag("--backend"); v != "vllm" {
		fail("--backend must be vllm (the workers speak vLLM's engine protocol), got %q", v)
	}
	if _, ok := flag("--service-discovery"); !ok {
		fail("--service-discovery is missing")
	}
	// A selector: the values after its flag up to the next flag.
	selectorArg := func(name string) map[string]string {
		sel := map[string]string{}
		for i, a := range c.Args {
			if a != name {
				continue
			}
			for _, kv := range c.Args[i+1:] {
				if len(kv) > 1 && kv[:2] == "--" {
					break
				}
				k, v, ok := cut(kv, "=")
				if !ok {
					fail("%s entry %q is not key=value", name, kv)
					continue
				}
				sel[k] = v
			}
		}
		return sel
	}
	selector := selectorArg("--selector")
	if _, pd := flag("--pd-disaggregation"); pd {
		// SMG's PD mode: one selector per role, each finding that role's pods and not the other's.
		errs = append(errs, checkPDRoles(g.Name, selectorArg, workers)...)
		selector = map[string]string{}
		for k, v := range selectorArg("--prefill-selector") {
			if selectorArg("--decode-selector")[k] == v {
				selector[k] = v // what both selectors share: it must find every worker (below)
			}
		}
	}
	if len(selector) == 0 {
		fail("--selector names no labels")
	}
	ws := labels.SelectorFromSet(selector)
	if len(workers) == 0 {
		fail("no worker Deployment to route to")
	}
	for _, w := range workers {
		if !ws.Matches(labels.Set(w.Spec.Template.Labels)) {
			fail("selector %v does not match the pods of worker Deployment %s", selector, w.Name)
		}
		wsel, _ := metav1.LabelSelectorAsSelector(w.Spec.Selector)
		if wsel != nil && !wsel.Empty() && wsel.Matches(podLabels) {
			fail("worker Deployment %s's selector matches the gateway's pods", w.Name)
		}
		if len(w.Spec.Template.Spec.Containers) == 1 {
			for _, p := range w.Spec.Template.Spec.Containers[0].Ports {
				if p.Name == "grpc" {
					if v, _ := flag("--service-discovery-port"); v != strconv.Itoa(int(p.ContainerPort)) {
						fail("--service-discovery-port %q is not the workers' gRPC port %d", v, p.ContainerPort)
					}
				}
			}
		}
	}
	if ws.Matches(podLabels) {
		fail("selector %v matches the gateway's own pods", selector)
	}
	if v, _ := flag("--service-discovery-namespace"); v == "" || v != g.Namespace && g.Namespace != "" {
		fail("--service-discovery-namespace must be the release namespace, got %q", v)
	}
	// Security: non-root, read-only root filesystem, a writable /tmp, memory limit.
	if psc := pod.Spec.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot {
		fail("pod securityContext.runAsNonRoot must be true")
	}
	if sc := c.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		fail("container needs readOnlyRootFilesystem and no privilege escalation")
	}
	tmp := false
	for _, m := range c.VolumeMounts {
		for _, v := range pod.Spec.Volumes {
			if v.Name == m.Name && m.MountPath == "/tmp" && v.EmptyDir != nil {
				tmp = true
			}
		}
	}
	if !tmp {
		fail("/tmp must be a writable emptyDir mount")
	}
	if c.Resources.Limits.Memory().IsZero() {
		fail("container needs a memory limit")
	}
	httpPort := int32(0)
	for _, p := range c.Ports {
		if p.Name == "http" {
			httpPort = p.ContainerPort
		}
	}
	if v, _ := flag("--port"); httpPort == 0 || v != strconv.Itoa(int(httpPort)) {
		fail("container port http (%d) must be the --port it serves (%q)", httpPort, v)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil {
		fail("needs an HTTP readiness probe")
	}
	// RBAC: the pod's ServiceAccount can get, list and watch pods.
	sa := pod.Spec.ServiceAccountName
	var haveSA bool
	roles := map[string]*rbacv1.Role{}
	var bindings []*rbacv1.RoleBinding
	var svcs []*corev1.Service
	var pdbs []*policyv1.PodDisruptionBudget
	for _, o := range objs {
		switch x := o.Obj.(type) {
		case *corev1.ServiceAccount:
			if x.Name == sa {
				haveSA = true
				if x.AutomountServiceAccountToken != nil && !*x.AutomountServiceAccountToken &&
					(pod.Spec.AutomountServiceAccountToken == nil || !*pod.Spec.AutomountServiceAccountToken) {
					fail("ServiceAccount %s mounts no token: the gateway cannot call the API", sa)
				}
			}
		case *rbacv1.Role:
			roles[x.Name] = x
		case *rbacv1.RoleBinding:
			bindings = append(bindings, x)
		case *corev1.Service:
			svcs = append(svcs, x)
		case *policyv1.PodDisruptionBudget:
			pdbs = append(pdbs, x)
		}
	}
	if sa == "" || !haveSA {
		fail("pod ServiceAccount %q is not among the objects", sa)
	}
	granted := false
	for _, b := range bindings {
		bound := false
		for _, s := range b.Subjects {
			if s.Kind == "ServiceAccount" && s.Name == sa {
				bound = true
			}
		}
		r, ok := roles[b.RoleRef.Name]
		if !bound || b.RoleRef.Kind != "Role" || !ok {
			continue
		}
		for _, rule := range r.Rules {
			if has(rule.APIGroups, "") && has(rule.Resources, "pods") && has(rule.Verbs, "list") &&
				has(rule.Verbs, "watch") && has(rule.Verbs, "get") {
				granted = true
			}
		}
	}
	if !granted {
		fail("no RoleBinding gives ServiceAccount %q a Role that can get, list and watch pods", sa)
	}
	// Services and PDBs: one Service exposes the gateway's http port; no worker Service or PDB selects it.
	exposed := false
	for _, s := range svcs {
		if len(s.Spec.Selector) == 0 || !labels.SelectorFromSet(s.Spec.Selector).Matches(podLabels) {
			continue
		}
		for _, p := range s.Spec.Ports {
			if p.TargetPort.StrVal == "http" || p.TargetPort.IntVal == httpPort {
				exposed = true
			}
		}
		for _, p := range s.Spec.Ports {
			if p.Name == "grpc" {
				fail("worker Service %s selects the gateway's pods", s.Name)
			}
		}
	}
	if !exposed {
		fail("no Service exposes the gateway's http port")
	}
	for _, p := range pdbs {
		if s, err := metav1.LabelSelectorAsSelector(p.Spec.Selector); err == nil && s.Matches(podLabels) {
			fail("PodDisruptionBudget %s selects the gateway's pods", p.Name)
		}
	}
	return errs
}

func has(list []string, want string) bool {
	for _, x := range list {
		if x == want || x == "*" {
			return true
		}
	}
	return false
}

func cut(s, sep string) (string, string, bool) {
	for i := 0; i+len(sep) <= len(s); i++ {
		if s[i:i+len(sep)] == sep {
			return s[:i], s[i+len(sep):], true
		}
	}
	return s, "", false
}

// checkPDRoles: in SMG's PD mode (--pd-disaggregation) the --prefill-selector finds exactly the
// prefill workers (--role prefill) and the --decode-selector exactly the decode workers; a prefill
// pod advertises the address decode pods pull its KV from ($(POD_IP) from status.podIP, on its gRPC
// port) and a decode pod names its KV peers (--kv-peer).
func checkPDRoles(name string, selectorArg func(string) map[string]string, workers []*appsv1.Deployment) []error {
	var errs []error
	fail := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("gateway %s: "+format, append([]any{name}, a...)...))
	}
	roleOf := func(w *appsv1.Deployment) string {
		if len(w.Spec.Template.Spec.Containers) != 1 {
			return ""
		}
		args := w.Spec.Template.Spec.Containers[0].Args
		for i, a := range args {
			if a == "--role" && i+1 < len(args) {
				return args[i+1]
			}
		}
		return ""
	}
	for _, role := range []string{"prefill", "decode"} {
		sel := selectorArg("--" + role + "-selector")
		if len(sel) == 0 {
			fail("--%s-selector names no labels", role)
			continue
		}
		found := 0
		for _, w := range workers {
			match := labels.SelectorFromSet(sel).Matches(labels.Set(w.Spec.Template.Labels))
			switch r := roleOf(w); {
			case r == role && !match:
				fail("--%s-selector %v does not match the pods of %s worker Deployment %s", role, sel, r, w.Name)
			case r != role && match:
				fail("--%s-selector %v matches the pods of worker Deployment %s (role %q)", role, sel, w.Name, r)
			case match:
				found++
			}
		}
		if found == 0 {
			fail("no --role %s worker Deployment for --%s-selector", role, role)
		}
	}
	for _, w := range workers {
		if len(w.Spec.Template.Spec.Containers) != 1 {
			continue
		}
		c := w.Spec.Template.Spec.Containers[0]
		switch roleOf(w) {
		case "prefill":
			grpc := int32(0)
			for _, p := range c.Ports {
				if p.Name == "grpc" {
					grpc = p.ContainerPort
				}
			}
			adv := ""
			for i, a := range c.Args {
				if a == "--advertise-address" && i+1 < len(c.Args) {
					adv = c.Args[i+1]
				}
			}
			podIP := false
			for _, e := range c.Env {
				if e.Name == "POD_IP" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil &&
					e.ValueFrom.FieldRef.FieldPath == "status.podIP" {
					podIP = true
				}
			}
			if adv != fmt.Sprintf("$(POD_IP):%d", grpc) || !podIP {
				fail("prefill worker %s must advertise $(POD_IP):%d (POD_IP from status.podIP), got %q", w.Name, grpc, adv)
			}
		case "decode":
			if !argsContain(c.Args, "--kv-peer") {
				fail("decode worker %s names no --kv-peer to pull prompts' KV from", w.Name)
			}
		}
	}
	return errs
}
