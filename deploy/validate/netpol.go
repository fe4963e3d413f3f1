package validate

import (
	"fmt"
	"regexp"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
)

// strangerLabels: a pod of some other workload in the namespace. No peer admitted to a worker's
// gRPC port may select it (an empty or too-wide podSelector would).
var strangerLabels = labels.Set{"app.kubernetes.io/name": "someone-else", "app.kubernetes.io/instance": "x"}

// checkGatewayFence: in gateway mode the workers take every call without a credential (SMG 1.13
// presents none), so NetworkPolicies must admit each worker's gRPC port from the gateway's pods and
// from nobody else, except that prefill workers also admit the decode workers (their KV pulls); the
// metrics port stays reachable when metrics are on; the gateway's own pods admit its HTTP port.
func checkGatewayFence(g *appsv1.Deployment, workers []*appsv1.Deployment, objs []Object, metrics bool) []error {
	var errs []error
	fail := func(format string, a ...any) { errs = append(errs, fmt.Errorf("gateway fence: "+format, a...)) }
	var pols []*networkingv1.NetworkPolicy
	for _, o := range objs {
		if p, ok := o.Obj.(*networkingv1.NetworkPolicy); ok {
			pols = append(pols, p)
		}
	}
	gwLabels := labels.Set(g.Spec.Template.Labels)
	roleOf := func(w *appsv1.Deployment) string { return w.Spec.Template.Labels["ferrum.io/role"] }
	var decodeLabels []labels.Set
	for _, w := range workers {
		if roleOf(w) == "decode" {
			decodeLabels = append(decodeLabels, labels.Set(w.Spec.Template.Labels))
		}
	}
	for _, w := range workers {
		wl := labels.Set(w.Spec.Template.Labels)
		grpcPort, metricsPort := int32(containerPort(w, "grpc")), int32(containerPort(w, "metrics"))
		// Who may select which peers: the gateway always, decode pods only on a prefill pod.
		allowed := []labels.Set{gwLabels}
		if roleOf(w) == "prefill" {
			allowed = append(allowed, decodeLabels...)
		}
		denied := []labels.Set{strangerLabels}
		for _, o := range workers {
			if roleOf(w) != "prefill" || roleOf(o) != "decode" {
				denied = append(denied, labels.Set(o.Spec.Template.Labels))
			}
		}
		selected, gatewayIn, decodeIn, metricsIn := false, false, false, false
		for _, p := range pols {
			sel, err := metav1.LabelSelectorAsSelector(&p.Spec.PodSelector)
			if err != nil || !sel.Matches(wl) || !ingressType(p) {
				continue
			}
			selected = true
			for _, rule := range p.Spec.Ingress {
				if admitsPort(rule.Ports, metricsPort, "metrics") {
					metricsIn = true
				}
				if !admitsPort(rule.Ports, grpcPort, "grpc") {
					continue
				}
				if len(rule.From) == 0 {
					fail("NetworkPolicy %s admits worker %s's gRPC port from any source", p.Name, w.Name)
				}
				for _, peer := range rule.From {
					if peer.IPBlock != nil || peer.NamespaceSelector != nil || peer.PodSelector == nil {
						fail("NetworkPolicy %s admits worker %s's gRPC port from an address block or other namespaces", p.Name, w.Name)
						continue
					}
					ps, err := metav1.LabelSelectorAsSelector(peer.PodSelector)
					if err != nil {
						fail("NetworkPolicy %s: bad podSelector: %v", p.Name, err)
						continue
					}
					for _, d := range denied {
						if ps.Matches(d) {
							fail("NetworkPolicy %s admits worker %s's gRPC port from pods like %v", p.Name, w.Name, d)
						}
					}
					known := false
					for _, a := range allowed {
						if ps.Matches(a) {
							known = true
						}
					}
					if !known {
						fail("NetworkPolicy %s admits worker %s's gRPC port from pods %v that are neither the gateway nor its KV peers", p.Name, w.Name, peer.PodSelector.MatchLabels)
					}
					gatewayIn = gatewayIn || ps.Matches(gwLabels)
					for _, d := range decodeLabels {
						decodeIn = decodeIn || ps.Matches(d)
					}
				}
			}
		}
		switch {
		case !selected:
			fail("no NetworkPolicy selects the pods of worker %s (they take calls without a credential)", w.Name)
		case !gatewayIn:
			fail("worker %s's gRPC port does not admit the gateway pods", w.Name)
		case roleOf(w) == "prefill" && !decodeIn:
			fail("prefill worker %s's gRPC port does not admit the decode pods (their KV pulls)", w.Name)
		case metrics && metricsPort != 0 && !metricsIn:
			fail("worker %s's metrics port %d is admitted from nowhere", w.Name, metricsPort)
		}
	}
	gwHTTP := int32(0)
	if cs := g.Spec.Template.Spec.Containers; len(cs) == 1 {
		for _, p := range cs[0].Ports {
			if p.Name == "http" {
				gwHTTP = p.ContainerPort
			}
		}
	}
	httpIn := true
	for _, p := range pols {
		if sel, err := metav1.LabelSelectorAsSelector(&p.Spec.PodSelector); err == nil && sel.Matches(gwLabels) && ingressType(p) {
			httpIn = false
			for _, rule := range p.Spec.Ingress {
				if admitsPort(rule.Ports, gwHTTP, "http") {
					httpIn = true
				}
			}
		}
	}
	if !httpIn {
		fail("the gateway's HTTP port %d is admitted from nowhere", gwHTTP)
	}
	return errs
}

// secretArg matches an argument that takes its secret from the environment: "$(NAME)", with a prefix.
var secretArg = regexp.MustCompile(`^(.*)\$\(([A-Za-z_][A-Za-z0-9_]*)\)$`)

// checkGatewayKeys: SMG's OpenAI API key (--api-key) and control-plane key (--control-plane-api-keys
// id:name:admin:KEY) both come from a Secret through the environment, from two different keys
// (with no control-plane key, SMG lets the API key manage its workers).
func checkGatewayKeys(g *appsv1.Deployment) []error {
	var errs []error
	fail := func(format string, a ...any) { errs = append(errs, fmt.Errorf("gateway keys: "+format, a...)) }
	if len(g.Spec.Template.Spec.Containers) != 1 {
		return nil
	}
	c := g.Spec.Template.Spec.Containers[0]
	source := func(flag string, prefix *regexp.Regexp) *corev1.SecretKeySelector {
		for i, a := range c.Args {
			if a != flag || i+1 >= len(c.Args) {
				continue
			}
			m := secretArg.FindStringSubmatch(c.Args[i+1])
			if m == nil || !prefix.MatchString(m[1]) {
				fail("%s %q does not take $(VAR) from the environment in the expected form", flag, c.Args[i+1])
				return nil
			}
			for _, e := range c.Env {
				if e.Name == m[2] && e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil && e.ValueFrom.SecretKeyRef.Name != "" {
					return e.ValueFrom.SecretKeyRef
				}
			}
			fail("%s: environment variable %s does not come from a Secret", flag, m[2])
			return nil
		}
		fail("%s is missing", flag)
		return nil
	}
	api := source("--api-key", regexp.MustCompile(`^$`))
	cp := source("--control-plane-api-keys", regexp.MustCompile(`^[^:]+:[^:]+:admin:$`))
	if api != nil && cp != nil && api.Name == cp.Name && api.Key == cp.Key {
		fail("the API key and the control-plane key are the same Secret key (%s/%s)", api.Name, api.Key)
	}
	return errs
}

func ingressType(p *networkingv1.NetworkPolicy) bool {
	if len(p.Spec.PolicyTypes) == 0 {
		return true // Ingress is implied
	}
	for _, t := range p.Spec.PolicyTypes {
		if t == networkingv1.PolicyTypeIngress {
			return true
		}
	}
	return false
}

// admitsPort: a rule's ports include the container port (by number or by name; no ports = all).
func admitsPort(ports []networkingv1.NetworkPolicyPort, port int32, name string) bool {
	if len(ports) == 0 {
		return true
	}
	for _, p := range ports {
		if p.Protocol != nil && *p.Protocol != corev1.ProtocolTCP {
			continue
		}
		if p.Port == nil {
			return true
		}
		if p.Port.StrVal == name && name != "" || p.Port.StrVal == "" && p.Port.IntVal == port && port != 0 {
			return true
		}
		if p.EndPort != nil && p.Port.StrVal == "" && p.Port.IntVal <= port && port <= *p.EndPort {
			return true
		}
	}
	return false
}
