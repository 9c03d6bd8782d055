package tests

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// FuzzName: any name gives no panic; a valid one round-trips to its key
// NAME/<lease-hex> through TryLock/Unlock and Campaign/Leader/Resign and
// leaves nothing behind; an invalid one gets ErrInvalidName and writes
// nothing. `go test` runs the seeds; `go test -fuzz FuzzName` explores.
func FuzzName(f *testing.F) {
	for _, seed := range []string{"", "a", "/a/b", "a\x00b", "\x00", "/", "ü", "\xff\xfe", "a/", strings.Repeat("n", 300)} {
		f.Add(seed)
	}
	c := etcdtest.Start(f, etcdtest.Options{})
	cli, err := clientv3.New(etcdtest.ClientConfig(c.Endpoints()))
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { cli.Close() })
	s, err := etcdsync.NewSession(cli)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { s.Close() })

	f.Fuzz(func(t *testing.T, name string) { checkName(t, cli, s, name) })
}

// checkName is FuzzName's property for one name.
func checkName(t *testing.T, cli *clientv3.Client, s *etcdsync.Session, name string) {
	{
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		invalid := name == "" || strings.ContainsRune(name, 0)
		m := etcdsync.NewMutex(s, name)
		e := etcdsync.NewElection(s, name)
		lockErr := m.TryLock(ctx)
		if invalid {
			if !errors.Is(lockErr, etcdsync.ErrInvalidName) {
				t.Fatalf("TryLock(%q) = %v, want ErrInvalidName", name, lockErr)
			}
			if err := e.Campaign(ctx, "v"); !errors.Is(err, etcdsync.ErrInvalidName) {
				t.Fatalf("Campaign(%q) = %v, want ErrInvalidName", name, err)
			}
			return
		}
		want := fmt.Sprintf("%s/%x", name, int64(s.Lease()))
		if lockErr != nil || m.Key() != want {
			t.Fatalf("TryLock(%q) = %v, key %q, want key %q", name, lockErr, m.Key(), want)
		}
		if err := m.Unlock(ctx); err != nil {
			t.Fatalf("Unlock(%q) = %v", name, err)
		}
		if err := e.Campaign(ctx, "v"); err != nil {
			t.Fatalf("Campaign(%q) = %v", name, err)
		}
		resp, err := e.Leader(ctx)
		if err != nil || string(resp.Kvs[0].Key) != want {
			t.Fatalf("Leader(%q) = %v, %v; want key %q", name, resp, err, want)
		}
		if err := e.Resign(ctx); err != nil {
			t.Fatalf("Resign(%q) = %v", name, err)
		}
		left, err := cli.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		if err != nil || left.Count != 0 {
			t.Fatalf("after %q: %v keys left (%v)", name, left.Count, err)
		}
	}
}
