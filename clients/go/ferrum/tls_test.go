package ferrum_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
	"github.com/ferrum-service/ferrum-service/clients/go/internal/testserver"
	"google.golang.org/grpc/codes"
)

// writeCert writes a certificate signed by parent (self-signed when parent is nil) and its key as
// PEM files into dir; it returns the certificate and key for signing others.
func writeCert(t *testing.T, dir, name string, tmpl *x509.Certificate, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	must0(t, os.WriteFile(filepath.Join(dir, name+".pem"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	must0(t, os.WriteFile(filepath.Join(dir, name+".key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: kder}), 0o600))
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func must0(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// Mutual TLS and a bearer token, with TLSConfigFromFiles and WithToken: the right client works;
// no client certificate, the wrong token, or plaintext do not.
func TestMutualTLSAndToken(t *testing.T) {
	client(t) // skips (or fails in CI) without a server
	dir := t.TempDir()
	now := time.Now()
	ca, caKey := writeCert(t, dir, "ca", &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test ca"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}, nil, nil)
	writeCert(t, dir, "server", &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "localhost"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), DNSNames: []string{"localhost"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		KeyUsage: x509.KeyUsageDigitalSignature}, ca, caKey)
	writeCert(t, dir, "client", &x509.Certificate{SerialNumber: big.NewInt(3), Subject: pkix.Name{CommonName: "scheduler"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		KeyUsage: x509.KeyUsageDigitalSignature}, ca, caKey)
	must0(t, os.WriteFile(filepath.Join(dir, "tokens"), []byte("s3cret-token\n"), 0o600))
	p := func(n string) string { return filepath.Join(dir, n) }

	cfg, err := ferrum.TLSConfigFromFiles(p("ca.pem"), p("client.pem"), p("client.key"), "")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	good := []ferrum.Option{ferrum.WithTLS(cfg), ferrum.WithToken("s3cret-token")}
	srv, err := testserver.StartDialing(ctx, []string{"configurable,id=m,vocab_size=100,token_sequence=5"}, good,
		"--tls-cert", p("server.pem"), "--tls-key", p("server.key"), "--tls-client-ca", p("ca.pem"),
		"--auth-token-file", p("tokens"))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()

	c := must(ferrum.Dial(srv.Target, good...))
	defer c.Close()
	out := must(c.Prefill(ctx, "m", []int32{1, 2}))
	if ferrum.Token(out.GetOutput()) != 5 {
		t.Fatalf("prefill over mTLS: %v", out)
	}
	short, cancel2 := context.WithTimeout(ctx, 5*time.Second)
	defer cancel2()
	wrong := must(ferrum.Dial(srv.Target, ferrum.WithTLS(cfg), ferrum.WithToken("nope")))
	defer wrong.Close()
	if _, err := wrong.Prefill(short, "m", []int32{1}); ferrum.Code(err) != codes.Unauthenticated {
		t.Fatalf("wrong token: %v", err)
	}
	noCert := must(ferrum.TLSConfigFromFiles(p("ca.pem"), "", "", ""))
	anon := must(ferrum.Dial(srv.Target, ferrum.WithTLS(noCert), ferrum.WithToken("s3cret-token")))
	defer anon.Close()
	if _, err := anon.Prefill(short, "m", []int32{1}); err == nil {
		t.Fatal("a client without a certificate was served")
	}
	plain := must(ferrum.Dial(srv.Target, ferrum.WithToken("s3cret-token")))
	defer plain.Close()
	if _, err := plain.Prefill(short, "m", []int32{1}); ferrum.Code(err) != codes.Unavailable {
		t.Fatalf("plaintext to a TLS server: %v", err)
	}
	if _, err := ferrum.TLSConfigFromFiles(p("ca.pem"), p("client.pem"), "", ""); err == nil {
		t.Fatal("a certificate without its key was accepted")
	}
	if _, err := ferrum.TLSConfigFromFiles(p("tokens"), "", "", ""); err == nil {
		t.Fatal("a CA file without a certificate was accepted")
	}
}
