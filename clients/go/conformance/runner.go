// Package conformance runs the language-neutral scenario tests/conformance/scenario.json (format:
// tests/conformance/README.md) through the Go client.
package conformance

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/encoding/protojson"
)

// Scenario is the parsed scenario file. Steps stay generic JSON (numbers as json.Number).
type Scenario struct {
	Version      int      `json:"version"`
	ServerModels []string `json:"server_models"`
	// Vars are seeded into the variables before the first step (steps read them as "$name").
	Vars     map[string]any     `json:"vars"`
	Profiles map[string]Profile `json:"profiles"`
	Steps    []map[string]any   `json:"steps"`
}

// Profile is another set of server models for the same steps, with the variables that differ.
type Profile struct {
	Description  string         `json:"description"`
	ServerModels []string       `json:"server_models"`
	Vars         map[string]any `json:"vars"`
}

// WithProfile is the scenario as profile name runs it: its server models, its vars over the
// top-level ones. "" is the scenario itself.
func (sc *Scenario) WithProfile(name string) (*Scenario, error) {
	if name == "" {
		return sc, nil
	}
	p, ok := sc.Profiles[name]
	if !ok {
		return nil, fmt.Errorf("conformance: no profile %q in the scenario", name)
	}
	out := *sc
	out.Vars = map[string]any{}
	for k, v := range sc.Vars {
		out.Vars[k] = v
	}
	for k, v := range p.Vars {
		out.Vars[k] = v
	}
	if len(p.ServerModels) > 0 {
		out.ServerModels = p.ServerModels
	}
	return &out, nil
}

// Load parses a scenario file.
func Load(path string) (*Scenario, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var sc Scenario
	if err := dec.Decode(&sc); err != nil {
		return nil, fmt.Errorf("conformance: %s: %w", path, err)
	}
	return &sc, nil
}

// StepResult is the outcome of one step.
type StepResult struct {
	ID     string
	Op     string
	Status string // PASS, FAIL, XFAIL or SKIP
	Error  string
	Took   time.Duration
}

// Summary is the outcome of a run.
type Summary struct {
	Passed, Failed, XFailed, Skipped int
	Steps                            []StepResult
}

// Servers are the run's servers: Main (every step's default) and Peer (the second server of the
// KV handoff steps; nil when the run has none), with their HOST:PORT targets.
type Servers struct {
	Main, Peer             *ferrum.Client
	MainTarget, PeerTarget string
}

func (s *Servers) get(name string) (*ferrum.Client, string, error) {
	switch name {
	case "", "main":
		return s.Main, s.MainTarget, nil
	case "peer":
		if s.Peer == nil {
			return nil, "", fmt.Errorf("no peer server in this run")
		}
		return s.Peer, s.PeerTarget, nil
	}
	return nil, "", fmt.Errorf("unknown server %q", name)
}

// Run executes every step in order on c (no peer) and writes one line per step and a final
// "N passed, N failed" line to out.
func Run(ctx context.Context, c *ferrum.Client, sc *Scenario, out io.Writer) Summary {
	return RunWith(ctx, &Servers{Main: c}, sc, out)
}

// RunWith executes every step in order on srv (seeding $main_target and $peer_target) and writes
// one line per step and a final "N passed, N failed" line to out. A step whose "requires"
// variable is not true is skipped (SKIP).
func RunWith(ctx context.Context, srv *Servers, sc *Scenario, out io.Writer) Summary {
	env := map[string]any{"main_target": srv.MainTarget, "peer_target": srv.PeerTarget}
	for k, v := range sc.Vars {
		env[k] = v
	}
	var sum Summary
	for _, raw := range sc.Steps {
		id, _ := raw["id"].(string)
		op, _ := raw["op"].(string)
		if req, _ := raw["requires"].(string); req != "" {
			if ok, _ := env[req].(bool); !ok {
				sum.Skipped++
				fmt.Fprintf(out, "SKIP %s (%s): requires %s\n", id, op, req)
				sum.Steps = append(sum.Steps, StepResult{ID: id, Op: op, Status: "SKIP"})
				continue
			}
		}
		start := time.Now()
		deadline := start.Add(time.Duration(num(raw["eventually_ms"])) * time.Millisecond)
		var err error
		for {
			err = runStep(ctx, srv, raw, env)
			if err == nil || !time.Now().Before(deadline) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		r := StepResult{ID: id, Op: op, Status: "PASS", Took: time.Since(start)}
		known, _ := raw["known_issue"].(string)
		switch {
		case err == nil:
			sum.Passed++
		case known != "":
			r.Status, r.Error = "XFAIL", err.Error()
			sum.XFailed++
		default:
			r.Status, r.Error = "FAIL", err.Error()
			sum.Failed++
		}
		line := fmt.Sprintf("%s %s (%s, %d ms)", r.Status, id, op, r.Took.Milliseconds())
		if r.Error != "" {
			line += ": " + r.Error
		}
		if known != "" && r.Status != "PASS" {
			line += " [known issue: " + known + "]"
		}
		fmt.Fprintln(out, line)
		sum.Steps = append(sum.Steps, r)
	}
	if sum.XFailed > 0 {
		fmt.Fprintf(out, "%d known issue(s) (XFAIL)\n", sum.XFailed)
	}
	if sum.Skipped > 0 {
		fmt.Fprintf(out, "%d skipped (SKIP: not supported by this profile)\n", sum.Skipped)
	}
	fmt.Fprintf(out, "%d passed, %d failed\n", sum.Passed, sum.Failed)
	return sum
}

var refRe = regexp.MustCompile(`^\$([A-Za-z_][A-Za-z0-9_]*)(?:\[(-?\d+)\])?$`)

// resolve replaces "$name" and "$name[i]" with saved values, recursively.
func resolve(v any, env map[string]any) (any, error) {
	switch x := v.(type) {
	case string:
		m := refRe.FindStringSubmatch(x)
		if m == nil {
			return x, nil
		}
		val, ok := env[m[1]]
		if !ok {
			return nil, fmt.Errorf("undefined variable $%s (the step that saves it failed?)", m[1])
		}
		if m[2] != "" {
			list, ok := val.([]any)
			i, _ := strconv.Atoi(m[2])
			if i < 0 {
				i += len(list)
			}
			if !ok || i < 0 || i >= len(list) {
				return nil, fmt.Errorf("%s: no such element in %v", x, val)
			}
			val = list[i]
		}
		return val, nil
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			r, err := resolve(e, env)
			if err != nil {
				return nil, err
			}
			out[i] = r
		}
		return out, nil
	case map[string]any:
		out := make(map[string]any, len(x))
		for k, e := range x {
			r, err := resolve(e, env)
			if err != nil {
				return nil, err
			}
			out[k] = r
		}
		return out, nil
	}
	return v, nil
}

// normalize round-trips a Go value through JSON so that it compares with the scenario's values.
func normalize(v any) any {
	raw, _ := json.Marshal(v)
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var out any
	_ = dec.Decode(&out)
	return out
}

func show(v any) string { b, _ := json.Marshal(v); return string(b) }

// mismatches: objects are subsets, lists exact (same length, null matches anything), scalars equal.
func mismatches(exp, act any, path string) []string {
	if exp == nil {
		return nil
	}
	switch e := exp.(type) {
	case map[string]any:
		a, ok := act.(map[string]any)
		if !ok {
			return []string{fmt.Sprintf("%s: expected an object, got %s", orResult(path), show(act))}
		}
		keys := make([]string, 0, len(e))
		for k := range e {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var out []string
		for _, k := range keys {
			p := k
			if path != "" {
				p = path + "." + k
			}
			av, ok := a[k]
			if !ok {
				out = append(out, p+": missing")
				continue
			}
			out = append(out, mismatches(e[k], av, p)...)
		}
		return out
	case []any:
		a, ok := act.([]any)
		if !ok || len(a) != len(e) {
			return []string{fmt.Sprintf("%s: expected %s, got %s", path, show(exp), show(act))}
		}
		for i := range e {
			if len(mismatches(e[i], a[i], "")) > 0 {
				return []string{fmt.Sprintf("%s: expected %s, got %s", path, show(exp), show(act))}
			}
		}
		return nil
	case json.Number:
		if a, ok := act.(json.Number); ok && numEq(e, a) {
			return nil
		}
	default:
		if exp == act {
			return nil
		}
	}
	return []string{fmt.Sprintf("%s: expected %s, got %s", path, show(exp), show(act))}
}

func numEq(a, b json.Number) bool {
	if a == b {
		return true
	}
	fa, e1 := a.Float64()
	fb, e2 := b.Float64()
	return e1 == nil && e2 == nil && fa == fb
}

func orResult(p string) string {
	if p == "" {
		return "result"
	}
	return p
}

func num(v any) int64 {
	switch x := v.(type) {
	case json.Number:
		if i, err := x.Int64(); err == nil {
			return i
		}
		f, _ := x.Float64()
		return int64(f)
	case float64:
		return int64(x)
	case int64:
		return x
	case int32:
		return int64(x)
	case int:
		return int64(x)
	}
	return 0
}

func flt(v any) float64 {
	switch x := v.(type) {
	case string:
		switch strings.ToLower(x) {
		case "nan":
			return math.NaN()
		case "infinity", "inf":
			return math.Inf(1)
		case "-infinity", "-inf":
			return math.Inf(-1)
		}
		f, _ := strconv.ParseFloat(x, 64)
		return f
	case json.Number:
		f, _ := x.Float64()
		return f
	}
	return float64(num(v))
}

func ints(v any) ([]int32, error) {
	list, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("expected a list of token ids, got %s", show(v))
	}
	out := make([]int32, len(list))
	for i, e := range list {
		out[i] = int32(num(e))
	}
	return out, nil
}

func str(m map[string]any, k string) string   { s, _ := m[k].(string); return s }
func boolean(m map[string]any, k string) bool { b, _ := m[k].(bool); return b }

func sampling(v any) *pb.SamplingParams {
	m, ok := v.(map[string]any)
	if !ok || len(m) == 0 {
		return nil
	}
	sp := &pb.SamplingParams{}
	for k, val := range m {
		switch k {
		case "temperature":
			sp.Temperature = float32(flt(val))
		case "top_p":
			f := float32(flt(val))
			sp.TopP = &f
		case "min_p":
			sp.MinP = float32(flt(val))
		case "repetition_penalty":
			f := float32(flt(val))
			sp.RepetitionPenalty = &f
		case "top_k":
			sp.TopK = uint32(num(val))
		case "seed":
			s := uint64(num(val))
			sp.Seed = &s
		case "constraint":
			raw, _ := json.Marshal(val)
			c := &pb.OutputConstraint{}
			if err := protojson.Unmarshal(raw, c); err == nil {
				sp.Constraint = c
			}
		}
	}
	return sp
}

func stepOpts(m map[string]any) []ferrum.StepOption {
	var o []ferrum.StepOption
	if sp := sampling(m["sampling"]); sp != nil {
		o = append(o, ferrum.WithSampling(sp))
	}
	if p, ok := m["position"]; ok && p != nil {
		o = append(o, ferrum.AtPosition(uint64(num(p))))
	}
	return o
}

func tokenOrNil(o *pb.LogitsOutput) any {
	if o == nil || o.TokenId == nil {
		return nil
	}
	return *o.TokenId
}

func handle(h *pb.KvCacheHandle) map[string]any {
	return map[string]any{"cache": h.GetCacheId(), "num_tokens": h.GetNumTokens(), "model_id": h.GetModelId()}
}

// execute runs one resolved step and returns its result object.
func execute(ctx context.Context, srv *Servers, s map[string]any) (map[string]any, error) {
	model := str(s, "model")
	c, _, err := srv.get(str(s, "server"))
	if err != nil {
		return nil, err
	}
	switch op := str(s, "op"); op {
	case "info":
		r, err := c.Info(ctx, model)
		if err != nil {
			return nil, err
		}
		models := map[string]any{}
		for _, mi := range r.GetModels() {
			models[mi.GetModelId()] = map[string]any{"vocab_size": mi.GetVocabSize(), "executor": mi.GetExecutor(),
				"has_tokenizer": mi.GetHasTokenizer(), "max_sequence_length": mi.GetMaxSequenceLength(),
				"eos_token_ids": append([]int32{}, mi.GetEosTokenIds()...)}
		}
		return map[string]any{"contract_version": r.GetContractVersion(), "server_version": r.GetServerVersion(), "models": models}, nil
	case "tokenize":
		ids, err := c.Tokenize(ctx, model, str(s, "text"), boolean(s, "add_special_tokens"))
		return map[string]any{"tokens": append([]int32{}, ids...)}, err
	case "detokenize":
		ids, err := ints(s["tokens"])
		if err != nil {
			return nil, err
		}
		text, err := c.Detokenize(ctx, model, ids, boolean(s, "skip_special_tokens"))
		return map[string]any{"text": text}, err
	case "prefill":
		ids, err := ints(s["tokens"])
		if err != nil {
			return nil, err
		}
		opts := stepOpts(s)
		if cid := str(s, "cache"); cid != "" {
			opts = append(opts, ferrum.Continue(cid))
		}
		if v := str(s, "cache_salt"); v != "" {
			opts = append(opts, ferrum.CacheSalt(v))
		}
		if boolean(s, "bypass_prefix_cache") {
			opts = append(opts, ferrum.BypassPrefixCache())
		}
		if v := str(s, "adapter"); v != "" {
			opts = append(opts, ferrum.Adapter(v))
		}
		out, err := c.Prefill(ctx, model, ids, opts...)
		if err != nil {
			return nil, err
		}
		r := handle(out.GetCache())
		r["token"] = tokenOrNil(out.GetOutput())
		r["cached_tokens"] = out.GetCachedTokens()
		return r, nil
	case "decode":
		out, err := c.Decode(ctx, model, str(s, "cache"), int32(num(s["token"])), stepOpts(s)...)
		if err != nil {
			return nil, err
		}
		r := handle(out.GetCache())
		r["token"] = tokenOrNil(out.GetOutput())
		return r, nil
	case "batch_decode":
		items, _ := s["inputs"].([]any)
		inputs := make([]*pb.DecodeInput, 0, len(items))
		for _, it := range items {
			m, _ := it.(map[string]any)
			inputs = append(inputs, ferrum.DecodeInput(str(m, "cache"), int32(num(m["token"])), stepOpts(m)...))
		}
		outs, err := c.BatchDecode(ctx, model, inputs)
		if err != nil {
			return nil, err
		}
		toks, lens, caches := []any{}, []any{}, []any{}
		for _, o := range outs {
			toks = append(toks, tokenOrNil(o.GetOutput()))
			lens = append(lens, o.GetCache().GetNumTokens())
			caches = append(caches, o.GetCache().GetCacheId())
		}
		return map[string]any{"tokens": toks, "num_tokens": lens, "caches": caches}, nil
	case "forward_verify":
		ids, err := ints(s["tokens"])
		if err != nil {
			return nil, err
		}
		r, err := c.ForwardVerify(ctx, model, str(s, "cache"), ids, boolean(s, "accept_greedy_prefix"), stepOpts(s)...)
		if err != nil {
			return nil, err
		}
		toks := []any{}
		for _, o := range r.GetOutputs() {
			toks = append(toks, tokenOrNil(o))
		}
		return map[string]any{"tokens": toks, "base_len": r.GetBaseLen(), "num_tokens": r.GetCache().GetNumTokens(),
			"accepted_drafts": r.GetAcceptedDrafts(), "accepted_tokens": append([]int32{}, r.GetAcceptedTokens()...)}, nil
	case "truncate":
		r, err := c.TruncateKv(ctx, model, str(s, "cache"), num(s["new_len"]))
		if err != nil {
			return nil, err
		}
		return map[string]any{"num_tokens": r.GetCache().GetNumTokens(), "removed_tokens": r.GetRemovedTokens()}, nil
	case "release":
		r, err := c.ReleaseCache(ctx, model, str(s, "cache"))
		if err != nil {
			return nil, err
		}
		return map[string]any{"released": r.GetReleased(), "freed_tokens": r.GetFreedTokens()}, nil
	case "generate":
		return generate(ctx, c, model, s)
	default:
		return executeMore(ctx, srv, c, model, s)
	}
}

func generate(ctx context.Context, c *ferrum.Client, model string, s map[string]any) (map[string]any, error) {
	var opts []ferrum.GenOption
	if v, ok := s["max_tokens"]; ok {
		opts = append(opts, ferrum.GenMaxTokens(uint32(num(v))))
	}
	if boolean(s, "ignore_eos") {
		opts = append(opts, ferrum.GenIgnoreEOS())
	}
	if v, ok := s["stop_token_ids"]; ok {
		ids, err := ints(v)
		if err != nil {
			return nil, err
		}
		opts = append(opts, ferrum.GenStopTokens(ids...))
	}
	if sp := sampling(s["sampling"]); sp != nil {
		opts = append(opts, ferrum.GenSampling(sp))
	}
	if v, ok := s["n"]; ok {
		opts = append(opts, ferrum.GenN(uint32(num(v))))
	}
	if v := str(s, "cache_salt"); v != "" {
		opts = append(opts, ferrum.GenCacheSalt(v))
	}
	if boolean(s, "bypass_prefix_cache") {
		opts = append(opts, ferrum.GenBypassPrefixCache())
	}
	if v := str(s, "adapter"); v != "" {
		opts = append(opts, ferrum.GenAdapter(v))
	}
	requestID := str(s, "request_id")
	if requestID != "" {
		opts = append(opts, ferrum.GenRequestID(requestID))
	}
	var req *pb.GenerateRequest
	if v, ok := s["tokens"]; ok {
		ids, err := ints(v)
		if err != nil {
			return nil, err
		}
		req = ferrum.GenerateTokens(model, ids, opts...)
	} else {
		req = ferrum.GenerateText(model, str(s, "text"), opts...)
	}
	cancelAfter, abortAfter := -1, -1
	if v, ok := s["cancel_after"]; ok && v != nil {
		cancelAfter = int(num(v))
	}
	if v, ok := s["abort_after"]; ok && v != nil {
		abortAfter = int(num(v))
	}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	res := map[string]any{"cancelled": false, "finish_reason": nil}
	var samples [][]int32
	var reasons []any
	grow := func(i uint32) {
		for uint32(len(samples)) <= i {
			samples = append(samples, []int32{})
			reasons = append(reasons, nil)
		}
	}
	grow(max(uint32(num(s["n"])), 1) - 1)
	count := 0
	endCode := "OK"
	for ev, err := range c.Generate(ctx, req) {
		if err != nil {
			if abortAfter < 0 {
				return nil, err
			}
			endCode = codeName(ferrum.Code(err))
			break
		}
		switch e := ev.GetEvent().(type) {
		case *pb.GenerateResponse_Started:
			res["cache"] = e.Started.GetCache().GetCacheId()
			res["prompt_tokens"] = e.Started.GetPromptTokens()
			res["cached_tokens"] = e.Started.GetCachedTokens()
		case *pb.GenerateResponse_Token:
			i := e.Token.GetSampleIndex()
			grow(i)
			samples[i] = append(samples[i], e.Token.GetTokenId())
			count++
		case *pb.GenerateResponse_Finished:
			f := e.Finished
			i := f.GetSampleIndex()
			grow(i)
			reasons[i] = strings.TrimPrefix(f.GetFinishReason().String(), "FINISH_REASON_")
			if i == 0 {
				res["finish_reason"] = reasons[0]
				res["prompt_tokens"] = f.GetPromptTokens()
				res["generated_tokens"] = f.GetGeneratedTokens()
				res["text"] = f.GetText()
			}
		}
		if cancelAfter >= 0 && count >= cancelAfter {
			res["cancelled"] = true
			break // leaving the loop cancels the call
		}
		if abortAfter >= 0 && count == abortAfter {
			if _, ok := res["aborted_streams"]; !ok {
				r, err := c.AbortRequest(ctx, model, requestID)
				if err != nil {
					return nil, err
				}
				res["aborted_streams"] = r.GetAbortedStreams()
			}
		}
	}
	if abortAfter >= 0 {
		res["end_code"] = endCode
	}
	res["tokens"] = samples[0]
	res["samples"] = samples
	res["finish_reasons"] = reasons
	return res, nil
}

var noCopyKeys = map[string]bool{"expect": true, "save": true, "id": true, "note": true, "known_issue": true}

func runStep(ctx context.Context, c *Servers, raw map[string]any, env map[string]any) error {
	step := map[string]any{}
	for k, v := range raw {
		if noCopyKeys[k] {
			continue
		}
		r, err := resolve(v, env)
		if err != nil {
			return err
		}
		step[k] = r
	}
	wantCode, _ := raw["expect_code"].(string)
	wantReason, _ := raw["expect_reason"].(string)
	result, err := execute(ctx, c, step)
	if err != nil {
		var fe *ferrum.Error
		if !errors.As(err, &fe) {
			return fmt.Errorf("unexpected error: %v", err)
		}
		got := codeName(fe.Code)
		if wantCode == "" {
			return fmt.Errorf("unexpected error %s (%s): %s", got, fe.Kind, fe.Message)
		}
		if got != wantCode {
			return fmt.Errorf("expected %s, got %s (%s): %s", wantCode, got, fe.Kind, fe.Message)
		}
		if wantReason != "" && fe.Kind != wantReason {
			return fmt.Errorf("expected ErrorInfo reason %s, got %q: %s", wantReason, fe.Kind, fe.Message)
		}
		return nil
	}
	norm, _ := normalize(result).(map[string]any)
	if wantCode != "" {
		return fmt.Errorf("expected %s, got success: %s", wantCode, show(norm))
	}
	exp, err := resolve(normalize(raw["expect"]), env)
	if err != nil {
		return err
	}
	if d := mismatches(exp, norm, ""); len(d) > 0 {
		return errors.New(strings.Join(d, "; "))
	}
	if save, ok := raw["save"].(map[string]any); ok {
		for field, v := range save {
			val, ok := norm[field]
			if !ok {
				return fmt.Errorf("save: no field %q in the result", field)
			}
			env[v.(string)] = val
		}
	}
	return nil
}

// codeName is the canonical name of a gRPC code, as in google.rpc.Code ("NOT_FOUND").
func codeName(c codes.Code) string {
	names := [...]string{"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
		"ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
		"OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"}
	if int(c) < len(names) {
		return names[c]
	}
	return fmt.Sprintf("CODE_%d", c)
}
