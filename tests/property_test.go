package tests

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
)

// No leftovers: Lock and Campaign cancelled at random points (before, during
// and after the create transaction, while waiting, or not at all) leave no
// key of theirs once the call has returned, and none once the session closed.
func TestNoLeftoversProperty(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0))
	holder := etcdsync.NewMutex(session(t, cli), "prop")
	s, err := etcdsync.NewSession(cli)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	mine := func() []string {
		var out []string
		for _, k := range keys(t, cli, "prop/") {
			if strings.HasSuffix(k, "/"+leaseHex(s)) {
				out = append(out, k)
			}
		}
		return out
	}
	const trials = 240
	for i := 0; i < trials; i++ {
		contended := i%2 == 0
		if contended {
			require.NoError(t, holder.Lock(ctx))
		}
		cctx, cancel := context.WithCancel(ctx)
		delay := time.Duration(rng.IntN(3000)) * time.Microsecond
		timer := time.AfterFunc(delay, cancel)
		var err error
		var release func() error
		if i%4 < 2 {
			m := etcdsync.NewMutex(s, "prop")
			err = m.Lock(cctx)
			release = func() error { return m.Unlock(ctx) }
		} else {
			e := etcdsync.NewElection(s, "prop")
			err = e.Campaign(cctx, "v")
			release = func() error { return e.Resign(ctx) }
		}
		timer.Stop()
		cancel()
		if err == nil {
			require.NotEmpty(t, mine(), "trial %d: held, key expected", i)
			require.NoError(t, release())
		}
		require.Empty(t, mine(), "trial %d (contended %v, cancel after %v, err %v)", i, contended, delay, err)
		if contended {
			require.NoError(t, holder.Unlock(ctx))
		}
	}
	require.NoError(t, s.Close())
	require.Empty(t, mine())
}

func leaseHex(s *etcdsync.Session) string { return fmt.Sprintf("%x", int64(s.Lease())) }
