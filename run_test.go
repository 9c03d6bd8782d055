package etcdsync_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// runner is one primitive's Run, with the prefix its keys live under.
type runner struct {
	name string
	run  func(ctx context.Context, fn func(context.Context) error) error
}

func runners(s *etcdsync.Session, name string) []runner {
	m := etcdsync.NewMutex(s, name+"-mutex")
	e := etcdsync.NewElection(s, name+"-election")
	rw := etcdsync.NewRWMutex(s, name+"-rwmutex")
	rr := etcdsync.NewRWMutex(s, name+"-rrun")
	sm := etcdsync.NewSemaphore(s, name+"-semaphore", 2)
	return []runner{
		{name + "-mutex/", m.Run},
		{name + "-election/", func(ctx context.Context, fn func(context.Context) error) error { return e.Run(ctx, "v", fn) }},
		{name + "-rwmutex/", rw.Run},
		{name + "-rrun/", rr.RRun},
		{name + "-semaphore/", func(ctx context.Context, fn func(context.Context) error) error { return sm.Run(ctx, 2, fn) }},
	}
}

// Run holds while fn runs and releases after it, also when ctx ended in fn
// or fn panicked; fn's error comes back.
func TestRunReleases(t *testing.T) {
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	errFn := errors.New("fn failed")
	for _, r := range runners(session(t, cli), "run") {
		t.Run(r.name, func(t *testing.T) {
			err := r.run(ctx, func(fctx context.Context) error {
				require.Len(t, keys(t, cli, r.name), 1, "the hold's key while fn runs")
				return errFn
			})
			require.ErrorIs(t, err, errFn)
			require.Empty(t, keys(t, cli, r.name))

			// ctx ends while fn runs: the release still happens.
			cctx, cancel := context.WithCancel(ctx)
			err = r.run(cctx, func(fctx context.Context) error {
				cancel()
				<-fctx.Done()
				return fctx.Err()
			})
			require.ErrorIs(t, err, context.Canceled)
			require.Empty(t, keys(t, cli, r.name))

			// A panic releases and goes on.
			require.PanicsWithValue(t, "boom", func() {
				r.run(ctx, func(context.Context) error { panic("boom") })
			})
			require.Empty(t, keys(t, cli, r.name))
		})
	}
}

// When the hold ends while fn runs (its key deleted by someone), fn's
// context ends at once with the cause, and Run returns it joined with fn's
// error.
func TestRunLoss(t *testing.T) {
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	for _, r := range runners(session(t, cli), "runloss") {
		t.Run(r.name, func(t *testing.T) {
			err := r.run(ctx, func(fctx context.Context) error {
				_, err := cli.Delete(ctx, r.name, clientv3.WithPrefix())
				require.NoError(t, err)
				select {
				case <-fctx.Done():
				case <-time.After(5 * time.Second):
					t.Fatal("fn's context did not end when the hold did")
				}
				require.ErrorIs(t, context.Cause(fctx), etcdsync.ErrNotHeld)
				return fctx.Err()
			})
			require.ErrorIs(t, err, context.Canceled)
			require.ErrorIs(t, err, etcdsync.ErrNotHeld)
			require.NotErrorIs(t, err, etcdsync.ErrLockReleased)
			require.Empty(t, keys(t, cli, r.name))
		})
	}
}

// An error before the hold (bad input, ctx ended) comes back without fn.
func TestRunAcquireFails(t *testing.T) {
	c := single(t)
	s := session(t, c.Client(t))
	ctx := ctxT(t)
	called := false
	fn := func(context.Context) error { called = true; return nil }
	require.ErrorIs(t, etcdsync.NewSemaphore(s, "runbad", 1).Run(ctx, 2, fn), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewRWMutex(s, "").RRun(ctx, fn), etcdsync.ErrInvalidName)
	ended, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, etcdsync.NewMutex(s, "runbad").Run(ended, fn), context.Canceled)
	require.False(t, called)
}
