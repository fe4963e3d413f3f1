package ferrum

import (
	pb "github.com/ferrum-service/ferrum-service/clients/go/gen/ferrum/executor/v1"
)

// GenOption adjusts a GenerateRequest built by GenerateTokens, GenerateText, GenerateChat or
// GenerateContinue.
type GenOption func(*pb.GenerateRequest)

// GenMaxTokens is the most tokens to generate (default 16).
func GenMaxTokens(n uint32) GenOption { return func(r *pb.GenerateRequest) { r.Stop.MaxTokens = n } }

// GenStopTokens stops after emitting one of ids (the stop token is emitted).
func GenStopTokens(ids ...int32) GenOption {
	return func(r *pb.GenerateRequest) { r.Stop.StopTokenIds = append(r.Stop.StopTokenIds, ids...) }
}

// GenStopSequences stops when the generated text contains one of seqs (needs a tokenizer).
func GenStopSequences(seqs ...string) GenOption {
	return func(r *pb.GenerateRequest) { r.Stop.StopSequences = append(r.Stop.StopSequences, seqs...) }
}

// GenIgnoreEOS keeps generating past the model's EOS tokens.
func GenIgnoreEOS() GenOption { return func(r *pb.GenerateRequest) { r.Stop.IgnoreEos = true } }

// GenSampling samples with p (default: greedy). See Sampling.
func GenSampling(p *pb.SamplingParams) GenOption {
	return func(r *pb.GenerateRequest) { r.Sampling = p }
}

// GenN generates n samples of the one prompt: it is prefilled once and samples 1..n-1 fork its
// cache. Events carry SampleIndex; sample i draws with seed + i*0x9E3779B9 (see SampleSeed).
func GenN(n uint32) GenOption { return func(r *pb.GenerateRequest) { r.N = n } }

// GenCacheSalt keys the new cache's prefix blocks under salt (tenant isolation).
func GenCacheSalt(salt string) GenOption { return func(r *pb.GenerateRequest) { r.CacheSalt = salt } }

// GenBypassPrefixCache computes every prompt token (nothing taken from the prefix cache).
func GenBypassPrefixCache() GenOption {
	return func(r *pb.GenerateRequest) { r.BypassPrefixCache = true }
}

// GenAdapter generates with the LoRA adapter name (registered with LoadAdapter).
func GenAdapter(name string) GenOption { return func(r *pb.GenerateRequest) { r.Adapter = name } }

// GenRequestID is the caller's id for the generation (AbortRequest stops it by this id).
func GenRequestID(id string) GenOption { return func(r *pb.GenerateRequest) { r.RequestId = id } }

// GenKeepCache keeps the cache when the generation ends (its handle is in the Finished event).
func GenKeepCache() GenOption { return func(r *pb.GenerateRequest) { r.KeepCache = true } }

// GenTopLogprobs returns the n most likely tokens with each token (0..64).
func GenTopLogprobs(n uint32) GenOption { return func(r *pb.GenerateRequest) { r.TopLogprobs = n } }

// GenStreamText sends each token's text piece (needs a tokenizer).
func GenStreamText() GenOption { return func(r *pb.GenerateRequest) { r.StreamText = true } }

func newGenerate(modelID string, opts []GenOption) *pb.GenerateRequest {
	r := &pb.GenerateRequest{ModelId: modelID, Stop: &pb.StopConditions{MaxTokens: 16}}
	for _, o := range opts {
		o(r)
	}
	return r
}

// GenerateTokens builds a GenerateRequest for a prompt of token ids.
func GenerateTokens(modelID string, ids []int32, opts ...GenOption) *pb.GenerateRequest {
	r := newGenerate(modelID, opts)
	r.Prompt = TokenPrompt(ids...)
	return r
}

// GenerateText builds a GenerateRequest for a text prompt (tokenized on the server).
func GenerateText(modelID, text string, opts ...GenOption) *pb.GenerateRequest {
	r := newGenerate(modelID, opts)
	r.Prompt = TextPrompt(text)
	return r
}

// GenerateChat builds a GenerateRequest for a conversation (the model's chat template, with the
// generation prompt).
func GenerateChat(modelID string, messages []*pb.ChatMessage, opts ...GenOption) *pb.GenerateRequest {
	r := newGenerate(modelID, opts)
	r.Prompt = &pb.GenerateRequest_Chat{Chat: &pb.ChatMessages{Messages: messages}}
	return r
}

// GenerateContinue builds a GenerateRequest that continues cacheID from lastToken (the last
// sampled token, fed first). The cache is kept when the generation ends.
func GenerateContinue(modelID, cacheID string, lastToken int32, opts ...GenOption) *pb.GenerateRequest {
	r := newGenerate(modelID, opts)
	r.CacheId, r.LastTokenId = cacheID, &lastToken
	return r
}

// SampleSeed is the seed sample i of a GenN request draws with, given the request's seed.
func SampleSeed(seed uint64, i uint32) uint64 {
	return (seed + uint64(i)*0x9E3779B9) % (1 << 63)
}

// SamplingOption adjusts SamplingParams built by Sampling.
type SamplingOption func(*pb.SamplingParams)

// Sampling is SamplingParams with temperature (0 = greedy) and options.
func Sampling(temperature float32, opts ...SamplingOption) *pb.SamplingParams {
	p := &pb.SamplingParams{Temperature: temperature}
	for _, o := range opts {
		o(p)
	}
	return p
}

// TopK keeps the k most likely tokens.
func TopK(k uint32) SamplingOption { return func(p *pb.SamplingParams) { p.TopK = k } }

// TopP is nucleus sampling, in (0, 1].
func TopP(v float32) SamplingOption { return func(p *pb.SamplingParams) { p.TopP = &v } }

// MinP filters tokens below v times the top probability, in [0, 1).
func MinP(v float32) SamplingOption { return func(p *pb.SamplingParams) { p.MinP = v } }

// RepetitionPenalty is the HF-style penalty (> 0) over ids (none = every token the cache holds).
func RepetitionPenalty(v float32, ids ...int32) SamplingOption {
	return func(p *pb.SamplingParams) { p.RepetitionPenalty, p.PenaltyTokenIds = &v, ids }
}

// Seed makes the draws reproducible (the draw at position p uses seed + p).
func Seed(s uint64) SamplingOption { return func(p *pb.SamplingParams) { p.Seed = &s } }

// TokenMask allows only the ids whose byte is non-zero (ids past its end are not allowed).
func TokenMask(mask []byte) SamplingOption { return func(p *pb.SamplingParams) { p.TokenMask = mask } }

// Constrain makes the sampled tokens spell text the constraint accepts (structured output; see
// JSONSchema, Regex, EBNFGrammar, LarkGrammar, Choice). Needs a model with a tokenizer.
func Constrain(c *pb.OutputConstraint) SamplingOption {
	return func(p *pb.SamplingParams) { p.Constraint = c }
}

// JSONSchema constrains the output to one JSON value valid under schema (JSON text), compact.
func JSONSchema(schema string) *pb.OutputConstraint {
	return &pb.OutputConstraint{Kind: &pb.OutputConstraint_JsonSchema{JsonSchema: schema}}
}

// Regex constrains the whole output to match the regular expression.
func Regex(re string) *pb.OutputConstraint {
	return &pb.OutputConstraint{Kind: &pb.OutputConstraint_Regex{Regex: re}}
}

// EBNFGrammar constrains the output to a GBNF grammar (`root ::= ...`).
func EBNFGrammar(g string) *pb.OutputConstraint {
	return &pb.OutputConstraint{Kind: &pb.OutputConstraint_EbnfGrammar{EbnfGrammar: g}}
}

// LarkGrammar constrains the output to a Lark grammar (`start: ...`).
func LarkGrammar(g string) *pb.OutputConstraint {
	return &pb.OutputConstraint{Kind: &pb.OutputConstraint_LarkGrammar{LarkGrammar: g}}
}

// Choice constrains the output to exactly one of choices.
func Choice(choices ...string) *pb.OutputConstraint {
	return &pb.OutputConstraint{Kind: &pb.OutputConstraint_Choice{Choice: &pb.ChoiceList{Choices: choices}}}
}
