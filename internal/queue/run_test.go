package queue

// RunIn, without a server: what fn's context carries and when it ends, what
// after gets, the order of begin's leave, and a panic.

import (
	"context"
	"errors"
	"testing"
	"time"
)

// fn's context ends with the hold's cause the moment the hold's ends; after
// gets fn's error, and RunIn returns what after returns; a begin that
// returns no leave is allowed.
func TestRunInEndsFnWithTheHoldsCause(t *testing.T) {
	hctx, end := context.WithCancelCause(context.Background())
	lost := errors.New("lost")
	var got error
	err := RunIn(context.Background(), hctx, func(context.CancelCauseFunc) (func(), error) { return nil, nil },
		func(err error) error { got = err; return errors.Join(err, ErrNotHeld) },
		func(fctx context.Context) error {
			end(lost)
			select {
			case <-fctx.Done():
			case <-time.After(10 * time.Second):
				t.Fatal("fn's context did not end with the hold's")
			}
			return context.Cause(fctx)
		})
	if !errors.Is(got, lost) {
		t.Fatalf("after got %v, want the hold's cause", got)
	}
	if !errors.Is(err, lost) || !errors.Is(err, ErrNotHeld) {
		t.Fatalf("RunIn returned %v, want what after returned", err)
	}
}

// begin's refusal goes to after instead of fn; leave runs once after has
// returned, also when fn panics, and the panic goes on after both.
func TestRunInLeavesAfterTheRelease(t *testing.T) {
	refused := errors.New("refused")
	var order []string
	begin := func(err error) func(context.CancelCauseFunc) (func(), error) {
		return func(context.CancelCauseFunc) (func(), error) {
			return func() { order = append(order, "leave") }, err
		}
	}
	after := func(err error) error { order = append(order, "after"); return err }
	err := RunIn(context.Background(), context.Background(), begin(refused), after, func(context.Context) error {
		t.Fatal("fn ran though begin refused")
		return nil
	})
	if !errors.Is(err, refused) || len(order) != 2 || order[0] != "after" || order[1] != "leave" {
		t.Fatalf("refused: err %v, order %v", err, order)
	}

	order = nil
	func() {
		defer func() {
			if p := recover(); p != "boom" {
				t.Fatalf("recovered %v, want the panic", p)
			}
		}()
		RunIn(context.Background(), context.Background(), begin(nil), after, func(context.Context) error { panic("boom") })
	}()
	if len(order) != 2 || order[0] != "after" || order[1] != "leave" {
		t.Fatalf("panic: order %v, want after then leave", order)
	}
}
