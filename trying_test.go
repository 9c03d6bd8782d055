package etcdsync_test

// Try forms: TryRun of every primitive and TryCampaign never queue. When the
// name is taken they return ErrLocked in one RPC that writes nothing, leave
// no key and do not run fn; when it is free they hold, run fn and release.

import (
	"context"
	"testing"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
)

// tryCase is a primitive's try form on a name that take (on another session)
// has taken.
type tryCase struct {
	name string
	take func(ctx context.Context, s *etcdsync.Session, name string) error
	try  func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error
}

var tryCases = []tryCase{
	{"Mutex.TryRun",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewMutex(s, name).Lock(ctx)
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewMutex(s, name).TryRun(ctx, fn)
		}},
	{"RWMutex.TryRun under a reader",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewRWMutex(s, name).RLock(ctx)
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewRWMutex(s, name).TryRun(ctx, fn)
		}},
	{"RWMutex.TryRRun under a writer",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewRWMutex(s, name).Lock(ctx)
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewRWMutex(s, name).TryRRun(ctx, fn)
		}},
	{"Semaphore.TryRun without room",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewSemaphore(s, name, 3).Acquire(ctx, 2)
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewSemaphore(s, name, 3).TryRun(ctx, 2, fn)
		}},
	{"Election.TryRun",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewElection(s, name).Campaign(ctx, "leader")
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewElection(s, name).TryRun(ctx, "v", fn)
		}},
	{"Election.TryCampaign",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewElection(s, name).Campaign(ctx, "leader")
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			e := etcdsync.NewElection(s, name)
			if err := e.TryCampaign(ctx, "v"); err != nil {
				return err
			}
			fn(ctx)
			return e.Resign(ctx)
		}},
}

// On a taken name a try form costs one RPC, writes nothing, leaves no key and
// does not run fn; once the name is free it runs fn while holding, and
// releases after.
func TestTryFormsNeverQueue(t *testing.T) {
	t.Parallel()
	c := single(t)
	var cnt counter
	cli := c.Client(t, cnt.dial()...)
	ctx := ctxT(t)
	for _, tc := range tryCases {
		t.Run(tc.name, func(t *testing.T) {
			name := "try-" + t.Name()
			holder := session(t, cli)
			require.NoError(t, tc.take(ctx, holder, name))
			held := keys(t, cli, name+"/")
			s := session(t, cli)
			before, err := cli.Get(ctx, "x")
			require.NoError(t, err)
			cnt.take()
			ran := false
			err = tc.try(ctx, s, name, func(context.Context) error { ran = true; return nil })
			n, methods := cnt.take()
			require.ErrorIs(t, err, etcdsync.ErrLocked)
			require.False(t, ran, "fn ran on a taken name")
			require.Equal(t, int64(1), n, "RPCs: %v", methods)
			after, err := cli.Get(ctx, "x")
			require.NoError(t, err)
			require.Equal(t, before.Header.Revision, after.Header.Revision, "a try on a taken name wrote")
			require.Equal(t, held, keys(t, cli, name+"/"))

			require.NoError(t, holder.Close())
			err = tc.try(ctx, s, name, func(ctx context.Context) error {
				ran = true
				require.Len(t, keys(t, cli, name+"/"), 1, "fn runs while holding")
				return nil
			})
			require.NoError(t, err)
			require.True(t, ran)
			require.Empty(t, keys(t, cli, name+"/"), "released after fn")
		})
	}
}

// TryCampaign on a value that leads is ErrLocked and keeps the term; a TryRun
// inside a Run's context enters the hold the context carries.
func TestTryFormsOnOwnHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "try-own")
	require.NoError(t, e.Campaign(ctx, "a"))
	rev := e.Rev()
	require.ErrorIs(t, e.TryCampaign(ctx, "b"), etcdsync.ErrLocked)
	require.Equal(t, rev, e.Rev(), "the term goes on")
	require.NoError(t, e.Resign(ctx))

	m := etcdsync.NewMutex(s, "try-own-m")
	inner := false
	require.NoError(t, m.Run(ctx, func(ctx context.Context) error {
		return etcdsync.NewMutex(s, "try-own-m").TryRun(ctx, func(context.Context) error {
			inner = true
			return nil
		})
	}))
	require.True(t, inner)
	require.Empty(t, keys(t, cli, "try-own-m/"))
}
