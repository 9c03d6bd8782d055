package tests

// Terms, Handover and TryCampaign through every deployment of the
// compatibility matrix (namespace, gRPC proxy, in-process client, wrapped
// client, etcd 3.4, 3.5 and 3.6 binaries).

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
)

func TestLeadershipThroughDeployments(t *testing.T) {
	t.Parallel()
	for _, rig := range compatRigs() {
		t.Run(rig.name, func(t *testing.T) {
			if testing.Short() && !rig.short {
				t.Skip("skipped in -short")
			}
			t.Parallel()
			d := rig.start(t)
			name := "deploy/leadership"
			leadershipCell(t, d, name)
			require.Empty(t, rawKeys(t, d, name), "keys left under %s", name)
			if d.after != nil {
				d.after(t)
			}
		})
	}
}

func leadershipCell(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 3)
	a, b, c := etcdsync.NewElection(ss[0], name), etcdsync.NewElection(ss[1], name), etcdsync.NewElection(ss[2], name)
	octx, stop := context.WithCancel(ctx)
	defer stop()
	terms := etcdsync.NewObserver(d.newClient(t), name).Terms(octx)
	next := func(what string) string {
		t.Helper()
		select {
		case tm, ok := <-terms:
			require.True(t, ok, "Terms closed before %s", what)
			if tm.Leader == nil {
				return ""
			}
			return string(tm.Leader.Value)
		case <-ctx.Done():
			t.Fatalf("Terms: no %s within %v", what, cellTimeout)
			return ""
		}
	}
	require.Equal(t, "", next("no leader at first"))

	var aWorking atomic.Bool
	started := make(chan struct{})
	aRun := async(func() error {
		return a.Run(ctx, "a", func(ctx context.Context) error {
			aWorking.Store(true)
			defer aWorking.Store(false)
			close(started)
			<-ctx.Done()
			time.Sleep(30 * time.Millisecond)
			return nil
		})
	})
	<-started
	require.Equal(t, "a", next("a leads"))
	require.ErrorIs(t, c.TryCampaign(ctx, "c"), etcdsync.ErrLocked)
	require.Len(t, rawKeys(t, d, name), 1, "a failed TryCampaign leaves no key")
	bLeads := async(func() error {
		if err := b.Campaign(ctx, "b"); err != nil {
			return err
		}
		if aWorking.Load() {
			return errors.New("b leads while a's Run works")
		}
		return nil
	})
	awaitKeys(t, d, name, 2)
	require.ErrorIs(t, c.TryCampaign(ctx, "c"), etcdsync.ErrLocked)
	require.NoError(t, a.Handover(ctx))
	require.NoError(t, resultWithin(t, aRun, cellTimeout, "a's Run returns"))
	require.NoError(t, resultWithin(t, bLeads, cellTimeout, "b leads"))
	require.Equal(t, "b", next("b leads, with no gap"))
	require.NoError(t, b.Proclaim(ctx, "b2"))
	require.Equal(t, "b2", next("b's proclamation"))
	require.NoError(t, b.Handover(ctx))
	require.Equal(t, "", next("no leader"))
	require.NoError(t, c.TryCampaign(ctx, "c"))
	require.Equal(t, "c", next("c leads by a try"))
	require.NoError(t, c.Resign(ctx))
	require.Equal(t, "", next("no leader again"))
}
