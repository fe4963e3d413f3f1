package ferrum

import (
	"testing"

	"google.golang.org/grpc/connectivity"
)

// The connections opened to follow migrated streams are the client's own: Close closes them.
func TestCloseClosesFollowConnections(t *testing.T) {
	c, err := Dial("127.0.0.1:1", WithToken("t"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.sibling("127.0.0.1:2")
	if err != nil {
		t.Fatal(err)
	}
	if again, _ := c.sibling("127.0.0.1:2"); again != s || s.token != "t" {
		t.Fatalf("sibling not reused (%p, %p) or without the token (%q)", again, s, s.token)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if st := s.conn.GetState(); st != connectivity.Shutdown {
		t.Fatalf("sibling connection is %v after Close", st)
	}
}
